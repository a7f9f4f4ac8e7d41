"""The commands of deltafin-run and deltafin-convert: main dispatches, each other module
is one command and a leaf (common, options and reply hold what commands share)."""
