"""A loaded model: load builds mlx-lm's model with its MoE blocks streamed (streaming_moe)
through one expert cache (cache, policy) fed by background readers (reader, linked_reader);
the trunk streamed where the plan says (trunk_stream); the state reached by runtime()."""
