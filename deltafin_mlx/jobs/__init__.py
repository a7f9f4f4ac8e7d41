"""Jobs over many requests: `batch` (generation) and `score` (teacher-forced
log-probabilities), their request lines, results files and progress."""
