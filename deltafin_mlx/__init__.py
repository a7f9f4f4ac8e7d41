"""Deltafin: stream MoE experts from disk, exactly, with MLX."""
