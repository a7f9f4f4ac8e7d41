"""`load`'s options are one LoadOptions, checked once when it is made: an unknown
option is refused naming it, a bad value is one line naming the option, and every
load flag of the command line sets its field (cli/options.py builds the options)."""

import argparse
from dataclasses import fields

import mlx.core as mx
import numpy as np
import pytest

import deltafin_mlx
from deltafin_mlx.cli.options import Parser, add_load_options, load_options
from deltafin_mlx.engine.load import LoadOptions, load
from deltafin_mlx.errors import BudgetError, DeltafinError, LoadOptionError


def test_an_unknown_option_is_refused_naming_it(converted):
    with pytest.raises(TypeError, match=r"no option 'reader_thread' \(did you mean "
                                        r"'reader_threads'\?\)"):
        load(converted("qwen3_moe"), reader_thread=2)
    with pytest.raises(TypeError, match="no option 'colour'"):
        LoadOptions.of(colour="blue")


@pytest.mark.parametrize("name,value", [
    ("reader_threads", -1), ("reader_threads", 1.5), ("reader_threads", True),
    ("read_mode", "fast"), ("record_checks", "never"), ("pipeline", "yes"),
    ("cache_slots", 0), ("sequences", 0), ("sequences", "many"), ("max_sequences", 0),
    ("activation_dtype", "bf16"), ("verify", "yes"), ("lookahead", 1),
    ("warm_start", None), ("group", "all"), ("activation_dtype", np.zeros(2)),
])
def test_a_bad_value_is_one_line_naming_the_option(name, value):
    with pytest.raises(LoadOptionError) as e:
        LoadOptions(**{name: value})
    msg = str(e.value)
    assert f"load option {name} must be" in msg and "\n" not in msg
    assert isinstance(e.value, (DeltafinError, ValueError))  # one line at the CLI; as before


@pytest.mark.parametrize("budget", ["lots", "-5GB", 0])
def test_a_budget_that_is_not_a_size_is_refused_when_the_options_are_made(budget):
    with pytest.raises(BudgetError, match="memory"):
        LoadOptions(memory_budget=budget)


def test_a_bad_value_is_refused_before_the_model_is_read(tmp_path):
    """Checked once, up front: no model directory is opened for options that
    cannot be used (this one does not exist)."""
    with pytest.raises(LoadOptionError, match="read_mode"):
        load(tmp_path / "no-such-model", read_mode="fast")


def test_good_values_are_kept_and_the_budget_as_bytes():
    o = LoadOptions(memory_budget="8GB", activation_dtype=mx.float32, reader_threads=0,
                    pipeline=False, record_checks="off", read_mode="mmap", cache_slots=3,
                    sequences="auto")
    assert o.memory_budget == 8_000_000_000 and o.activation_dtype == mx.float32
    assert (o.reader_threads, o.pipeline, o.read_mode, o.sequences) == (0, False, "mmap", "auto")
    assert LoadOptions.of(o, context=100).context == 100 and o.context == 4096  # a copy
    for name in ("auto", "model", "float32", "bfloat16", "float16"):  # --activation-dtype's
        assert LoadOptions(activation_dtype=name).activation_dtype == name


def test_load_takes_options_keyword_arguments_or_both(converted):
    """The README's `deltafin_mlx.load(path, budget, **options)` keeps working; with
    `options=` too, the keyword arguments change it."""
    from deltafin_mlx.engine.runtime import runtime

    path = converted("qwen3_moe")
    for kwargs in ({"memory_budget": "200MB", "context": 256, "cache_slots": 5},
                   {"options": LoadOptions(memory_budget="200MB", context=999, cache_slots=5),
                    "context": 256}):
        model, tok = deltafin_mlx.load(path, tokenizer=False, **kwargs)
        plan = runtime(model).plan
        assert tok is None and plan.context == 256 and plan.slots <= 5
        runtime(model).close()


def _flags_parser():
    p = Parser(prog="t")
    p.add_argument("--context", type=int, default=None)
    add_load_options(p)
    return p


# A value other than each flag's default, and the field it must set.
FLAG_VALUES = {
    "--budget": (["--budget", "3GB"], "memory_budget", 3_000_000_000),
    "--reader-threads": (["--reader-threads", "3"], "reader_threads", 3),
    "--no-lookahead": (["--no-lookahead"], "lookahead", False),
    "--verify": (["--verify"], "verify", True),
    "--read-mode": (["--read-mode", "mmap"], "read_mode", "mmap"),
    "--no-warm-start": (["--no-warm-start"], "warm_start", False),
    "--context": (["--context", "77"], "context", 77),
    "--activation-dtype": (["--activation-dtype", "model"], "activation_dtype", "model"),
}
NOT_LOAD_OPTIONS = {"--debug", "--help"}


def test_every_load_flag_of_the_command_line_sets_a_field():
    p = _flags_parser()
    flags = {s for a in p._actions for s in a.option_strings if s.startswith("--")}
    assert flags - NOT_LOAD_OPTIONS == set(FLAG_VALUES)  # a new flag needs a row here
    names = {f.name for f in fields(LoadOptions)}
    default = load_options(p.parse_args([]))
    for flag, (argv, field, want) in FLAG_VALUES.items():
        assert field in names
        got = load_options(p.parse_args(argv))
        assert getattr(got, field) == want != getattr(default, field), flag
        changed = {f.name for f in fields(LoadOptions)
                   if getattr(got, f.name) != getattr(default, f.name)}
        assert changed == {field}, flag


def test_extra_fields_from_a_command_override_its_flags():
    args = _flags_parser().parse_args(["--context", "77"])
    assert load_options(args, context=12, tokenizer=False).context == 12
    with pytest.raises(TypeError, match="no option 'budget'"):
        load_options(argparse.Namespace(**vars(args)), budget="1GB")
