"""The counters line of a run stopped before its first token."""

from deltafin_mlx.generation.stream import RunStats


def test_a_prefill_stopped_before_any_token_says_what_it_did():
    line = RunStats(prompt_tokens=512, seconds=4.0).line()
    assert line.startswith("no token generated: stopped in the prefill after 512 prompt "
                           "tokens in 4.00 s (128.0 tok/s)")
    assert "first token after" not in line


def test_the_line_ends_with_what_the_model_computed_in():
    assert RunStats(tokens=3, seconds=1.0, activation_dtype="bfloat16").line().endswith(
        "; activations bfloat16")
