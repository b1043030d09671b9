"""The chat settings travel with the data: `prepare` records them, `generate` carries them, the cache
manifest holds them (valid against the schema), training writes them into the export's
`dflash_config.chat`, and `eval --prompts` of prompts rendered another way (thinking off for a
drafter trained with thinking on) warns."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

import _chat
from conftest import SCHEMA_PATH, SMALL_OPTS, TRAIN, run_cli


@pytest.fixture(scope="module")
def chat_target(tiny_dense, tmp_path_factory):
    return _chat.make_chat_target(tiny_dense, tmp_path_factory.mktemp("chat") / "target")


def test_chat_settings_reach_the_export_and_eval_warns_on_another_mode(chat_target, tmp_path):
    rng = random.Random(7)
    convs = [{"id": i, "messages": _chat.random_conversation(rng, tools=False)[:2]} for i in range(24)]
    data = _chat.write_jsonl(tmp_path / "c.jsonl", convs)
    r = run_cli(["prepare", "--target", chat_target, "--data", data, "--out", tmp_path / "on", "--thinking", "on",
                 "--max-len", "400", "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = json.loads((tmp_path / "on" / "train" / "manifest.json").read_text())["chat"]
    assert recorded["thinking"] == "on" and recorded["reads_thinking"]
    r = run_cli(["generate", "--target", chat_target, "--prompts", tmp_path / "on" / "train", "--out", tmp_path / "gen",
                 "--max-new-tokens", "6", "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "gen" / "manifest.json").read_text())["chat"]["template_sha256"] == \
        recorded["template_sha256"]
    r = run_cli(["extract", "--target", chat_target, "--data", tmp_path / "gen", "--cache", tmp_path / "cache",
                 *SMALL_OPTS])
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert m["chat"] == {k: v for k, v in recorded.items() if k != "template"}
    jsonschema.validate(m, json.loads(SCHEMA_PATH.read_text()))
    r = run_cli(["train", "--target", chat_target, "--cache", tmp_path / "cache", "--out", tmp_path / "run", *TRAIN,
                 "--max-steps", "2", "--checkpoint-every", "100"])
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "run" / "export" / "config.json").read_text())
    assert cfg["dflash_config"]["chat"]["thinking"] == "on"
    assert cfg["dflash_config"]["chat"]["template_sha256"] == recorded["template_sha256"]
    eval_args = ["eval", "--target", chat_target, "--drafter", tmp_path / "run" / "export", "--max-new-tokens", "4",
                 "--max-prompts", "2", "--no-progress", "--log-dir", tmp_path / "logs"]
    r = run_cli([*eval_args, "--prompts", tmp_path / "on" / "train"])
    assert r.returncode == 0 and "rendered another way" not in r.stderr, r.stderr[-2000:]
    r = run_cli(["prepare", "--target", chat_target, "--data", data, "--out", tmp_path / "off", "--thinking", "off",
                 "--max-len", "400", "--no-progress"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli([*eval_args, "--prompts", tmp_path / "off" / "train"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rendered another way" in r.stderr and "thinking on vs off" in r.stderr, r.stderr[-2000:]
