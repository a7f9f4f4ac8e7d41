"""The mlx-lm drop-in: the model file mlx-lm imports for a converted directory
(shim) and the request checks it installs inside mlx_lm.server (guard)."""
