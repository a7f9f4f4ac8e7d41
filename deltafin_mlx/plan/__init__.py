"""Planning: arithmetic over a model's inventory and a budget, no weight I/O: the memory
plan, slot geometry, passes, context steps, disk needs and projected speed."""
