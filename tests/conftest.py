"""Shared fixtures: tiny generated source checkpoints, their conversions, and the
oracle — the same source quantized by mlx-lm itself and run fully in memory
(helpers.py makes them; tests that call them directly import helpers)."""

import os
import shutil
from pathlib import Path

import pytest

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.engine.load import load

from helpers import FAST, close, first_logits, make_source, reference_model


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path_factory, monkeypatch):
    """Every test has its own user cache directory: a hot set saved by one test (or by
    the user's own runs) never warms another test's cache (engine/hot_set.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_source(root / arch, arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def eight_layers(tmp_path_factory):
    """K3's layout with 8 layers, converted (its source beside it, `src`): a whole-prompt prefill or a long text
    in one pass needs far more memory than the model itself (hundreds of MB over a
    floor of ~18 MB), so passes show in its peaks."""
    root = tmp_path_factory.mktemp("eight_layers")
    src = make_source(root / "src", "kimi_k3", num_layers=8)
    convert(str(src), root / "model", ConvertOptions(progress=False))
    return root / "model"


@pytest.fixture(scope="session")
def wide_experts(tmp_path_factory):
    """K3's layout with many experts for the experts a token uses (K3: 896 for 16),
    each big beside a token's activations (418 KB): at 40 MB the cache holds 49 of
    the 384 and a pass gets their memory."""
    root = tmp_path_factory.mktemp("wide_experts")
    src = make_source(root / "src", "kimi_k3", num_experts=128, experts_per_token=4,
                      moe_intermediate_size=512, routed_expert_hidden_size=512)
    convert(str(src), root / "model", ConvertOptions(progress=False))
    return root / "model"


@pytest.fixture(scope="session")
def converted(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("converted")
    cache = {}

    def get(arch):
        if arch not in cache:
            out = root / arch
            convert(str(sources(arch)), out, ConvertOptions(progress=False))
            cache[arch] = out
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def references(sources):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = reference_model(sources(arch))
        return cache[arch]

    return get


@pytest.fixture
def copy_of(tmp_path):
    def copy(path):
        dst = tmp_path / Path(path).name
        shutil.copytree(path, dst)
        return dst

    return copy


@pytest.fixture
def no_disk_measurement(monkeypatch):
    """bench's projection needs a disk rate: a fixed one here, not a scratch file's."""
    import deltafin_mlx.plan.report as plan_cli

    monkeypatch.setattr(plan_cli, "measure_disk_gbps", lambda *a, **k: 2.0)


@pytest.fixture
def src_copy(sources, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(sources("kimi_k3"), dst)
    return dst


@pytest.fixture(scope="module")
def k3(converted):
    return converted("kimi_k3")


@pytest.fixture(scope="module")
def clean(k3):
    model, _ = load(k3, **FAST)
    out = first_logits(model)
    close(model)
    return out


@pytest.fixture(scope="module")
def work(k3, tmp_path_factory):
    """A copy of the model to damage (restored after each case) next to a decoy
    directory holding valid copies of its files, which hostile paths point at."""
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(k3, root / "model")
    shutil.copytree(k3 / "experts", root / "decoy")
    shutil.copytree(k3 / "trunk", root / "decoy", dirs_exist_ok=True)
    return root / "model"


# End-to-end tests, marked `e2e` here in one table rather than by decorators spread
# over the files. They run whole commands in fresh processes (each pays the runtime's
# imports, a second of CPU, before it does anything), start servers or mlx.launch ranks,
# convert from a hub, loop over kill points or fuzz cases: the README verbatim, the
# demo, servers under load, Ctrl-C and SIGKILL loops, and any test that takes more than
# a few seconds alone. `pytest -m "not e2e"` is the fast run for edits (every stage is
# still covered in-process); the full run (no -m) is what CI and a release run.
# Entries are fnmatch patterns over node ids without their [parameters]; `file::*`
# marks a whole file.
E2E = [
    # whole files: ranks, load, hub conversions, mlx_lm.server through the drop-in
    "tests/model/test_distributed.py::*",
    "tests/server/test_server_load.py::*",
    "tests/server/test_stalled_bodies.py::*",
    "tests/server/test_scoring_server.py::*",
    "tests/convert/test_hub.py::*",
    "tests/convert/test_hub_downloads.py::*",
    "tests/convert/test_hub_scratch.py::*",
    "tests/convert/test_hub_cache_refs.py::*",
    "tests/convert/test_refused_before_download.py::*",
    "tests/convert/test_original_layouts.py::test_an_mlx_community_*",
    "tests/convert/test_original_layouts.py::test_a_release_converts_from_the_hub_*",
    "tests/dropin/*::*",
    # the README and the demo
    "tests/cli/test_readme.py::test_readme_examples_run_verbatim",
    "tests/cli/test_demo.py::*",
    "tests/cli/test_cli.py::test_demo_builds_converts_and_streams",
    # Ctrl-C, SIGKILL and kill-and-resume loops; fuzzing
    "tests/*::test_ctrl_c_*",
    "tests/*::test_*killed*",
    "tests/convert/test_killed_conversions.py::test_sigkill_*",
    "tests/format/test_damaged_files.py::test_fuzzed_*",
    "tests/format/test_damaged_files.py::test_random_byte_damage_to_the_manifest",
    "tests/convert/test_killed_conversions.py::test_disk_full_mid_conversion_is_one_line_and_resumable",
    "tests/convert/test_killed_conversions.py::test_too_little_space_up_front_*",
    "tests/convert/test_convert.py::test_killed_conversion_resumes",
    "tests/convert/test_convert.py::test_peak_memory_is_bounded_by_the_largest_layer",
    "tests/convert/test_synthetic.py::test_memory_stays_bounded",
    # deltafin-run, deltafin-convert or a server as a process, a few seconds each
    "tests/cli/test_cli.py::test_run_streams_text_and_ends_with_one_stats_line",
    "tests/cli/test_cli.py::test_json_output_has_text_tokens_and_stats",
    "tests/cli/test_cli.py::test_prompt_from_stdin_equals_prompt_argument",
    "tests/cli/test_cli.py::test_stop_string_ends_the_text_before_it",
    "tests/tokenizer/test_chat_template_bounds.py::test_a_hostile_template_is_a_400_in_serve_*",
    "tests/cli/test_cli.py::test_chat_keeps_history_and_answers_commands",
    "tests/cli/test_cli.py::test_bench_subcommand_reports_tokens_per_second",
    "tests/cli/test_cli.py::test_trace_routing_writes_one_line_per_token",
    "tests/cli/test_cli.py::test_bad_input_is_one_line_and_a_non_zero_exit",
    "tests/cli/test_cli.py::test_mlx_lm_generate_runs_a_converted_directory",
    "tests/cli/test_cli.py::test_*serve*",
    "tests/format/test_verify.py::test_verify_names_every_damaged_file_and_record",
    "tests/cli/test_paths.py::test_load_and_the_cli_expand_a_tilde",
    "tests/cli/test_output.py::test_output_into_a_closed_pipe_ends_quietly",
    "tests/convert/test_source_checks.py::test_oddly_*",
    "tests/engine/test_token_ids.py::test_out_*",
    "tests/convert/test_source_checks.py::test_out_*",
    "tests/convert/test_source_checks.py::test_src_inside_out_is_refused_even_with_force",
    "tests/tokenizer/test_tokenizer_files.py::test_emptied_special_token_resealed_is_one_line_not_a_hang",
    "tests/chat/test_chat.py::test_cli_chat_commands_multiline_and_a_resumed_session",
    "tests/convert/test_linked.py::test_a_linked_source_*",
    "tests/convert/test_linked.py::test_linked_experts_*",
    "tests/engine/test_prefill_memory.py::*",
    "tests/engine/test_runtime.py::test_peak_memory_stays_within_budget_when_experts_are_4x_the_budget",
    "tests/generation/test_stats.py::*",
    "tests/jobs/test_score.py::test_cli_*",
    "tests/jobs/test_score.py::test_run_json_top_logprobs",
    "tests/server/test_server_options.py::test_requests_beyond_the_places_*",
    "tests/server/test_server_options.py::test_a_port_in_use_*",
    "tests/server/test_server_options.py::test_a_config_naming_another_model_file_*",
    "tests/server/test_server_requests.py::test_after_every_hostile_request_*",
    "tests/tokenizer/test_tokenizer.py::test_encoding_from_hundreds_of_threads_keeps_memory_flat",
    "tests/cli/test_cli.py::test_sampling_options_are_reproducible_with_a_seed",
    "tests/cli/test_cli.py::test_no_think_changes_the_prompt",
    "tests/plan/test_plan_command.py::test_plan_takes_a_hub_id_fetching_only_its_config",
    "tests/cli/test_options.py::test_stop_before_the_prompt_takes_one_value_and_repeats",
    "tests/plan/test_bench_command.py::test_bench_*",
    "tests/generation/test_penalties.py::test_penalties_in_run_chat_and_batch_give_mlx_lm_s_tokens",
    "tests/jobs/test_score.py::test_fifo_or_directory_input_and_output_are_one_line_errors",
    # in one process, but sweeps of several seconds each (measured: CPU time above ~3.5 s
    # on a loaded 2-core machine); the fast run keeps one exactness check per stage
    "tests/chat/test_chat_context.py::test_the_context_grows_in_steps_*",
    "tests/chat/test_chat_context.py::test_at_the_terminal_the_context_grows_*",
    "tests/engine/test_prefill_pass.py::test_greedy_tokens_and_logits_equal_mlx_lm_prefilling_*",
    "tests/engine/test_prefill_pass.py::test_a_batch_of_long_prompts_equals_each_prompt_alone",
    "tests/engine/test_runtime.py::test_mlx_keeps_freed_buffers_only_within_the_working_buffers",
    "tests/jobs/test_batch.py::test_greedy_batch_equals_each_prompt_run_alone",
    "tests/jobs/test_batch.py::test_experts_are_read_once_per_step_for_the_whole_batch",
    "tests/jobs/test_lm_eval.py::test_loglikelihoods_equal_deltafin_score_for_the_same_strings",
    "tests/jobs/test_lm_eval.py::test_deltafin_lm_eval_reports_an_error_in_one_line",
    "tests/jobs/test_perplexity.py::test_perplexity_equals_the_same_windows_scored_through_jsonl",
    "tests/jobs/test_perplexity.py::test_ctrl_c_keeps_the_windows_scored_*",
    "tests/jobs/test_score.py::test_texts_longer_than_an_attention_group_are_exact_too",
    # added with issues 29-33 (a full run's durations, 2026-12-03: 4-16 s each)
    "tests/jobs/test_score_streaming.py::test_a_job_of_many_windows_scores_every_line_once",
    "tests/jobs/test_long_texts.py::*",
    "tests/jobs/test_job_inputs.py::test_a_score_line_longer_than_*",
    "tests/jobs/test_job_inputs.py::test_a_stdin_the_temporary_folder_*",
    "tests/model/test_config_sizes.py::test_float_experts_*",
    "tests/jobs/test_score_sweeps.py::test_16_texts_*",
    "tests/jobs/test_score_outputs_safety.py::test_a_full_disk_*",
    "tests/jobs/test_score_outputs_safety.py::test_only_a_shard_of_its_own_*",
    "tests/jobs/test_score_outputs_safety.py::test_two_jobs_in_one_folder_*",
    "tests/convert/test_mlx_lm_format.py::test_an_mlx_community_repository_converts_from_the_hub_*",
    "tests/convert/test_mlx_lm_format.py::test_conversion_memory_*",
    "tests/chat/test_paste_and_drop.py::test_at_the_terminal_*",
    "tests/chat/test_chat_commands.py::test_a_session_on_a_full_disk_*",
    "tests/generation/test_request_rule.py::test_a_real_batch_job_and_a_real_server_agree",
    "tests/server/test_prefix_cache.py::*",
    "tests/server/test_first_token_fairness.py::*",
    "tests/server/test_server_endpoints.py::test_forty_simultaneous_clients_*",
    "tests/cli/test_convert_interrupt.py::*",
    # issue 30: every mlx-lm MoE type (2-10 s each, ~4 min loaded); commands and servers
    # on a new family
    "tests/convert/test_every_moe_type.py::test_every_moe_type_streams_to_mlx_lms_tokens",
    "tests/convert/test_every_moe_type.py::test_every_moe_type_runs_through_every_command",
    "tests/convert/test_every_command_on_a_new_family.py::*",
    # issue 31's measured bars, in fresh processes (at full size, DELTAFIN_FULL_BARS=1,
    # the 20,000-token text takes ~20 min at 40 MB on a loaded 2-core machine)
    "tests/engine/test_pass_bars.py::test_a_long_text_*",
    "tests/engine/test_pass_bars.py::test_a_scoring_job_*",
    # issue 40: serve and the drop-in in processes of their own
    "tests/generation/test_one_engine.py::test_every_process_entry_point_*",
    "tests/generation/test_one_engine.py::test_the_drop_in_refuses_*",
    # a wide trunk streamed through long prompts and scoring passes (15-45 s each); the
    # fast run keeps its plan and its fits-beside-the-cache case
    "tests/engine/test_trunk_pass.py::test_a_long_prompt_streams_*",
    "tests/engine/test_trunk_pass.py::test_scoring_passes_stream_*",
    "tests/engine/test_trunk_pass.py::test_a_stop_while_the_trunk_*",
    # issue 42: stock mlx-lm's tokens at --activation-dtype model, five more families and
    # through the drop-in (the fast run keeps qwen3_moe's)
    "tests/generation/test_activation_dtype.py::test_*_on_more_families",
    "tests/generation/test_activation_dtype.py::test_the_drop_in_*",
]


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker a core, at most four. Each worker builds
    its own session fixtures (sources, conversions, oracles), so more workers buy
    little and cost memory; a file stays on one worker (`--dist loadfile`), its
    module fixtures built once."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    import fnmatch

    for item in items:
        node = item.nodeid.split("[", 1)[0]
        if any(fnmatch.fnmatchcase(node, p) for p in E2E):
            item.add_marker(pytest.mark.e2e)
