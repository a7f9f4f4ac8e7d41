"""Chat: a session that keeps the model's cache across turns, its context growth,
and its session file."""
