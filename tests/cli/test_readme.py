"""The README's examples, run exactly as written."""

import os
import re
import shutil
import subprocess
import sys

from deltafin_mlx.format.manifest import MANIFEST_NAME

from helpers import BIN, REPO, fake_hub_cache


def readme_blocks(lang):
    text = (REPO / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


# Lines the test does not run, and why.
NOT_RUN = {
    "python3 -m venv": "the set-up itself (this test runs inside it)",
    "mlx_lm.server": "a server runs until stopped (tests/cli/test_cli.py serves requests)",
    "deltafin-run serve": "a server runs until stopped (tests/server/test_server_*.py serve requests)",
    "curl -s localhost:8080": "requests to that server (tests/server/test_server_endpoints.py sends them)",
    "pip install -q \".[eval]\"": "the test extra already holds lm-eval",
    "deltafin-lm-eval": "its tasks download datasets (tests/jobs/test_lm_eval.py runs a local task)",
    "mlx_lm dwq": "DWQ needs a vocabulary of 1,024 or more (tests/dropin/test_dwq.py runs both "
                  "steps on a local dataset)",
    "lm_eval --model local-completions": "needs the server above and downloads its task "
                                         "(tests/server/test_scoring_server.py runs lm-eval's client)",
}


def test_readme_examples_run_verbatim(tmp_path, sources):
    """Every command of the README, as written, after the set-up with the venv
    active: HOME, the hub cache and the working directory hold tiny generated
    stand-ins for the checkpoints the README names (Kimi K3, an mlx-community
    Qwen3-MoE and DeepSeek-V3's FP8 release on the hub, in offline mode, and a local
    Qwen3-MoE directory)."""
    home, work, hf = tmp_path / "home", tmp_path / "work", tmp_path / "hf"
    home.mkdir(), work.mkdir()
    fake_hub_cache(hf, "moonshotai/Kimi-K3", sources("kimi_k3"))
    from deltafin_mlx.testing.mlx_lm_format import write_mlx_lm_format

    fake_hub_cache(hf, "mlx-community/Qwen3-30B-A3B-4bit",
                   write_mlx_lm_format(sources("qwen3_moe"), tmp_path / "mlx-community", bits=4))
    from deltafin_mlx.testing.original_layouts import write_original

    fake_hub_cache(hf, "deepseek-ai/DeepSeek-V3",
                   write_original(tmp_path / "deepseek-ai", "deepseek_v3_fp8"))
    shutil.copytree(sources("qwen3_moe"), work / "Qwen3-30B-A3B")
    (work / "prompt.txt").write_text("Why is the sky blue?")
    (work / "wiki.test.raw").write_text("The sky is blue because air scatters short waves. " * 40)
    (work / "prompts.jsonl").write_text('{"id": "q1", "prompt": "Why is the sky blue?"}\n'
                                        '{"id": 2, "prompt": "Hi", "max_tokens": 4}\n')
    for name in ("texts.jsonl", "corpus.jsonl"):  # score's inputs
        (work / name).write_text('{"id": "t1", "text": "Every token of this text is scored."}\n'
                                 '{"id": "mc-3", "prompt": "The capital of France is", '
                                 '"completion": " Paris"}\n')
    env = {"HOME": str(home), "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "XDG_CACHE_HOME": "",
           "VIRTUAL_ENV": str(BIN.parent)}
    lines = [l for block in readme_blocks("sh") for l in block.splitlines() if l.strip()]
    ran = 0
    for line in lines:
        if any(line.startswith(k) or k in line for k in NOT_RUN):
            continue
        # stdin at its end: a chat starts and ends at once
        p = subprocess.run(["bash", "-c", line], cwd=work, capture_output=True, text=True,
                           timeout=600, input="", env={**os.environ, **env})
        assert p.returncode == 0 and "Traceback" not in p.stderr, f"{line}\n{p.stderr[-2000:]}"
        ran += 1
    assert ran >= 15
    assert (home / "models" / "k3" / MANIFEST_NAME).exists()
    for block in readme_blocks("python"):
        p = subprocess.run([sys.executable, "-c", block], cwd=work, capture_output=True,
                           text=True, timeout=600, env={**os.environ, **env})
        assert p.returncode == 0, f"{block}\n{p.stderr[-2000:]}"
        assert "tok/s" in p.stdout
