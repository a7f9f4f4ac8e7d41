"""Generation: the token stream, its stats, sampling, stop strings and
log-probabilities."""
