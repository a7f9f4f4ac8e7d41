"""One question per module, each run as `python -m bench.studies.NAME`."""
