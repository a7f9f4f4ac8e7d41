"""mlx-lm's own model class for a converted directory: config.json's rules, the build,
quantization, module replacement and tensor-parallel sharding."""
