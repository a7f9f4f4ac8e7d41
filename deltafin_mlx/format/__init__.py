"""The on-disk contract of a converted model directory: what the converter writes and
every command reads (docs/FORMAT.md), opened once per command (model_dir)."""
