"""Teacher-forced scoring: the log-probability of given texts and the model's
top-K distribution at each of their positions, many texts per sweep over the
experts (see job.py)."""
