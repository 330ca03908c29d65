"""Models, tokenizers and datasets by Hugging Face Hub id, against a real Hub protocol server on 127.0.0.1 (olah, see
tests/hub_server.py): ``pf-trl train --model_name_or_path ORG/NAME --dataset_name ORG/NAME`` trains to the same losses
as the same run from local copies; revisions, configs, a new commit, offline runs from the cache; one-line failures.

Every run is a ``pf-trl`` / python process with the Hub's own environment (``HF_ENDPOINT``, ``HF_HOME``, ``HF_TOKEN``,
``HF_HUB_OFFLINE``): huggingface_hub reads it when it is imported. The runs that share that environment run in one
process (the ``runs`` fixture: one interpreter start instead of one per test), each test checking its own group.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from hub_server import HubServer, closed_port, olah_or_skip, run

from test_service_support import wait_state
from tolerances import assert_bit_equal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PF_TRL = str(Path(sys.executable).parent / "pf-trl")
# why a run from Hub ids equals the run from the local copies to the bit: the same operations in the same order
SAME_FILES = "the same model and data files from the Hub and from a folder: the same rows, batches and packing"


def _chat(n: int, tag: str) -> str:
    return "\n".join(json.dumps({"messages": [{"role": "user", "content": f"{tag} question {i}"},
                                              {"role": "assistant", "content": f"{tag} answer number {i}"}]})
                     for i in range(n)) + "\n"


README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train.jsonl
  - split: test
    path: data/test.jsonl
- config_name: short
  data_files:
  - split: train
    path: short/train.jsonl
---
# chat
"""

MULTI_FILES = {"data/train-b.jsonl": _chat(5, "mb"), "data/train-a.jsonl": _chat(3, "ma"),
               "data/train-c.jsonl": _chat(4, "mc")}
MULTI_TRAIN = list(MULTI_FILES)  # the order the card lists them, the order datasets resolves and pf-trl concatenates
MULTI_README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: [data/train-b.jsonl, data/train-a.jsonl, data/train-c.jsonl]
  - split: test
    path: data/test.jsonl
- config_name: other
  data_files:
  - split: train
    path: other/train.jsonl
- config_name: up
  data_files:
  - split: train
    path: [data/train-a.jsonl, ../x.jsonl]
- config_name: odd
  data_files:
  - split: train
    path: [data/train-a.jsonl, data/notes.txt, data/train-b.jsonl]
---
# multi
"""

SECRET = "PF-SECRET-OUTSIDE-7c1e"  # the rows of a file outside org/evil: they must land in no cache and no shard
EVIL_README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: {leak}
- config_name: up
  data_files:
  - split: train
    path: ../../../../../../../../../..{leak}
- config_name: url
  data_files:
  - split: train
    path: http://127.0.0.1:{port}/leak.jsonl
---
# evil
"""


# a model repository with its own code (config.json auto_map), as Hub repositories of new architectures ship it:
# its classes subclass transformers' Llama, and its tokenizer is a class of its own too
CUSTOM_CONFIG = """from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    model_type = "pf_custom_llama"
"""
CUSTOM_MODEL = """from transformers import LlamaForCausalLM

from .configuration_custom import CustomLlamaConfig


class CustomLlamaForCausalLM(LlamaForCausalLM):
    config_class = CustomLlamaConfig
"""
CUSTOM_TOKENIZER = """from transformers import LlamaTokenizer


class CustomTokenizer(LlamaTokenizer):
    pass
"""


def _custom_code_model(folder: Path) -> Path:
    """A tiny Llama made a custom-code repository: model_type pf_custom_llama (not shipped by transformers), auto_map
    to configuration_custom / modeling_custom, a tokenizer class of its own (tokenization_custom)."""
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model

    build_model("pf-trl/tiny-llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="pf_custom_llama", architectures=["CustomLlamaForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomLlamaConfig",
                            "AutoModelForCausalLM": "modeling_custom.CustomLlamaForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer.update(tokenizer_class="CustomTokenizer",
                     auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
    for name, text in (("configuration_custom.py", CUSTOM_CONFIG), ("modeling_custom.py", CUSTOM_MODEL),
                       ("tokenization_custom.py", CUSTOM_TOKENIZER)):
        (folder / name).write_text(text)
    return folder


def _text_rows(n: int) -> str:
    """About n kB of chat rows."""
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                            {"role": "assistant", "content": "word " * 200}]}) + "\n"
                   for i in range(n))


# the Hub server's access rules
RULES = {"gated": {"org/gated": "good"}, "unsized": ["org/unsized", "org/multiunsized"]}
LIMIT = 2_000_000  # the service's hub_max_download_bytes
# a split of two files each under LIMIT, together over it (distinct bytes: the same bytes twice are one blob)
MULTI_HALVES = {"data/train-0.jsonl": _text_rows(1100), "data/train-1.jsonl": _text_rows(1101)}


def _pairs(n: int) -> str:
    words = "the a cat dog runs sleeps blue green red house tree over under with".split()
    rows = [{"prompt": " ".join(words[(i + k) % len(words)] for k in range(4)),
             "chosen": " ".join(words[(2 * i + k) % len(words)] for k in range(3 + i % 4)),
             "rejected": " ".join(words[(3 * i + k) % len(words)] for k in range(2 + i % 5))} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The server with org/tiny (a tiny Llama saved from a config with the shipped tokenizer, tag v1, then a second
    commit on main), org/chat (two configs, train / test splits; org/moving holds the same and is the one a test commits
    to), org/gated (gated: token "good"), org/broken (a bad JSON line), org/custom (a model of its own code) and
    org/pairs (preference rows); local copies of the model at v1, of the custom model and of the datasets."""
    python = olah_or_skip()
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model

    root = tmp_path_factory.mktemp("hub")
    server = HubServer(python, root / "server").start()
    model = root / "tiny-v1"
    tiny = build_model("pf-trl/tiny-llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)
    tiny.save_pretrained(model)
    tokenizer = load_tokenizer()
    tokenizer.save_pretrained(model)
    files = {f.name: f for f in model.iterdir()}
    v1 = server.commit("models", "org/tiny", files, "tiny model", tag="v1")
    other = root / "tiny-v2"  # main moves on: other weights (seed 1), same tokenizer
    build_model("pf-trl/tiny-llama", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(other)
    server.commit("models", "org/tiny", {f.name: f for f in other.iterdir()}, "retrained")
    data = {"README.md": README, "data/train.jsonl": _chat(12, "a"), "data/test.jsonl": _chat(4, "t"),
            "short/train.jsonl": _chat(6, "s")}
    chat_v1 = server.commit("datasets", "org/chat", data, "chat data")
    server.commit("datasets", "org/gated", data, "gated data")
    server.commit("datasets", "org/moving", data, "chat data")  # gets a new commit in a test; org/chat never changes
    server.commit("datasets", "org/broken", {"README.md": "# broken\n",
                                             "train.jsonl": _chat(2, "b") + '{"messages": [}\n'}, "broken")
    local_data = root / "chat-local"
    shutil.copytree(server.repo("datasets", "org/chat"), local_data, ignore=shutil.ignore_patterns(".git"))
    custom = _custom_code_model(root / "custom")
    server.commit("models", "org/custom", {f.name: f for f in custom.iterdir()}, "a model of its own code")
    server.commit("datasets", "org/pairs", {"README.md": "# pairs\n", "data/train.jsonl": _pairs(8)}, "pairs")
    local_pairs = root / "pairs-local"
    shutil.copytree(server.repo("datasets", "org/pairs"), local_pairs, ignore=shutil.ignore_patterns(".git"))
    # org/big: the tiny model's weights in shards (an index), with what transformers never reads beside them
    big = root / "big"
    tiny.save_pretrained(big, max_shard_size="1MB")
    tokenizer.save_pretrained(big)
    strays = {"consolidated.safetensors": model / "model.safetensors",
              "checkpoint-1/model.safetensors": model / "model.safetensors",
              "checkpoint-1/config.json": model / "config.json", "awq/config.json": model / "config.json"}
    server.commit("models", "org/big", {**{f.name: f for f in big.iterdir()}, **strays}, "sharded, with strays")
    # org/evil: a dataset card whose configurations name files outside the repository
    leak = root / "outside" / "leak.jsonl"
    leak.parent.mkdir()
    leak.write_text(_chat(4, SECRET))
    server.commit("datasets", "org/evil", {"README.md": EVIL_README.format(leak=leak, port=closed_port()),
                                           "data/train.jsonl": _chat(4, "e")}, "a card pointing outside")
    server.commit("datasets", "org/fresh", {"README.md": "# fresh\n", "data/train.jsonl": _chat(6, "f")}, "fresh")
    # over the service's download limit (LIMIT), its size told by the Hub and not told; under it, about 1 MB
    over = _text_rows(3000)
    server.commit("datasets", "org/large", {"README.md": "# large\n", "data/train.jsonl": over}, "3 MB")
    server.commit("datasets", "org/unsized", {"README.md": "# unsized\n", "data/train.jsonl": over}, "3 MB")
    server.commit("datasets", "org/medium", {"README.md": "# medium\n", "data/train.jsonl": _text_rows(1200)}, "1 MB")
    server.commit("datasets", "org/racing", {"README.md": "# racing\n", "data/train.jsonl": _chat(6, "r")}, "racing")
    # org/multi: a train split of three files (listed out of name order), a test split and another configuration;
    # configurations `up` and `odd` name a file outside the repository and a file of a suffix pf-trl does not read
    server.commit("datasets", "org/multi", {"README.md": MULTI_README, **MULTI_FILES, "data/test.jsonl": _chat(2, "mt"),
                                            "data/notes.txt": "notes\n", "other/train.jsonl": _chat(2, "mo")},
                  "a split of several files")
    # a split of two files each under the service's download limit, together over it (sizes told / not told)
    halves = MULTI_HALVES
    server.commit("datasets", "org/multibig", {"README.md": "# multibig\n", **halves}, "2 x 1.2 MB")
    server.commit("datasets", "org/multiunsized", {"README.md": "# multiunsized\n", **halves}, "2 x 1.2 MB")
    server.set_rules(**RULES)
    yield {"server": server, "root": root, "model": model, "data": local_data, "v1": v1, "chat_v1": chat_v1,
           "custom": custom, "pairs": local_pairs, "big": big, "leak": leak}
    server.stop()


def _ids_steps(base: Path, hub) -> list:
    """Hub ids at a pinned revision and a config, then the same run from the local copies; the Hub answers the first
    two file downloads 429 (huggingface_hub waits and retries)."""
    def train(out: str, *args: str) -> list:
        return ["main", ["train", *args, "--max_steps", "3", "--logging_steps", "1", "--max_tokens_per_batch", "64",
                         "--seed", "0", "--report_to", "none", "--output_dir", str(base / out)], {}]

    rules = str(hub["server"].rules)
    return [["rules", [rules, {**RULES, "busy": 2}], {}],
            train("hub", "--model_name_or_path", "org/tiny", "--model_revision", "v1", "--dataset_name", "org/chat",
                  "--dataset_config", "default", "--dataset_train_split", "train"),
            train("local", "--model_name_or_path", str(hub["model"]), "--dataset_name", str(hub["data"]),
                  "--dataset_config", "default"),
            ["rules", [rules, RULES], {}]]


def test_hub_ids_train_to_the_local_copies_losses_with_a_pinned_revision_and_a_config(hub, runs):
    results, base = runs["ids"]
    for rc, err, *_ in results[1:3]:
        assert rc == 0, err[-3000:]
    from_hub, local = _state_losses(base / "hub"), _state_losses(base / "local")
    assert len(from_hub) == 3
    assert_bit_equal(from_hub, local, why=SAME_FILES)
    # negative control: main holds other weights than v1, so a revision not honoured would give other losses
    main = Path(hub["server"].repo("models", "org/tiny")) / "model.safetensors"
    assert main.read_bytes() != (hub["model"] / "model.safetensors").read_bytes()
    manifests = [json.loads(p.read_text()) for p in (base / "pf" / "datasets").glob("*/pf_manifest.json")]
    hub_made = [m for m in manifests if m["source"].get("hub")]
    assert hub_made and all(m["source"]["hub"] == {"repo_id": "org/chat", "repo_type": "dataset", "revision": None,
                                                   "commit": hub["chat_v1"]} for m in hub_made)
    assert {m["tokenizer"]["hub"]["commit"] for m in hub_made} >= {hub["v1"]}
    assert results[3][4].get("busy") == 0  # the 429s were served (the rules as the two runs left them)


IDENTITY = r"""
import json, os, subprocess, sys
from pf_trl.data.local_datasets import dataset_splits
from pf_trl.data.pretokenize import PretokenizeConfig
from pf_trl.data.sources import cached_shards
from pf_trl.data.tokenizer import load_tokenizer

tok = load_tokenizer("org/tiny", revision="v1")
def shards(config=None):
    said = []
    path = dataset_splits("org/moving", config=config)["train"][0]
    target = cached_shards(path, tok, PretokenizeConfig(), progress=False, say=said.append)
    return [os.path.basename(target), said[-1].split(":")[1].strip().split(" ")[0]]
offline = os.environ.get("HF_HUB_OFFLINE") == "1"
out = [shards(), shards("short")] if not offline else [shards()]
if offline:  # the short config was read at an older commit only: not in the cache at main's commit
    try:
        shards("short")
    except Exception as exc:
        out.append(str(exc))
if len(sys.argv) > 1:  # the same ids again (a cache hit is the cache on disk), a new commit on main, the id again
    out += [shards(), shards("short")]
    repo = sys.argv[1]
    with open(os.path.join(repo, "data", "train.jsonl"), "a") as fh:
        row = {"messages": [{"role": "user", "content": "new"}, {"role": "assistant", "content": "row"}]}
        fh.write(json.dumps(row) + "\n")
    git = ["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-qam", "more"], check=True)
    out.append(shards())
print("RESULT " + json.dumps(out))
"""


def _identity(env, *args: str) -> list[list[str]]:
    proc = run([sys.executable, "-c", IDENTITY, *args], env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def _identity_steps(base: Path, hub) -> list:
    return [["script", [IDENTITY, str(hub["server"].repo("datasets", "org/moving"))], {}]]


def test_cache_identity_follows_the_commit_and_runs_offline_from_the_cache(runs):
    ((rc, err, said, *_),), base = runs["identity"]
    assert rc == 0, err[-3000:]
    read = json.loads(said.split("RESULT ", 1)[1])
    first, again = read[:2], read[2:]
    assert [kind for _, kind in first] == ["tokenizing", "tokenizing"] and first[0][0] != first[1][0]  # two configs
    assert again[:2] == [[first[0][0], "cache"], [first[1][0], "cache"]]  # same commit: cache hit, no tokenizing
    assert again[2][1] == "tokenizing" and again[2][0] != first[0][0]  # a new commit on main: new shards
    # a process of its own: huggingface_hub reads HF_HUB_OFFLINE when imported
    offline = _identity({**runs["env"], "PF_TRL_CACHE": str(base / "pf"), "HF_HUB_OFFLINE": "1"})
    assert offline[0] == [again[2][0], "cache"]  # offline: the cached commit of main, from the cache
    # only what was read is cached: the short config was never read at main's new commit
    assert "HF_HUB_OFFLINE" in offline[1] and "does not hold this configuration's files" in offline[1], offline[1]


def _failure_cases(base: Path) -> list:
    """(HF_TOKEN, argv, words of the one line); the last, with the right token, is the control."""
    out = ["--output_dir", str(base / "out")]
    model = ["train", "--model_name_or_path", "org/tiny"]
    return [
        (None, ["train", "--model_name_or_path", "org/missing", "--dataset_name", "org/chat", *out],
         ["--model_name_or_path org/missing", "no model repository org/missing", "HF_TOKEN"]),
        (None, [*model, "--model_revision", "v9", "--dataset_name", "org/chat", *out],
         ["--model_name_or_path org/tiny (revision v9)", "no revision 'v9'"]),
        (None, [*model, "--dataset_name", "org/nothing", *out],
         ["--dataset_name org/nothing", "no dataset repository"]),
        (None, [*model, "--dataset_name", "org/gated", *out],
         ["--dataset_name org/gated", "gated", "HTTP 401", "hf auth login", "HF_TOKEN"]),
        ("bad", [*model, "--dataset_name", "org/gated", *out], ["--dataset_name org/gated", "gated", "HTTP 403"]),
        (None, [*model, "--dataset_name", "org/broken", *out], ["--dataset_name", "line 3"]),
        (None, [*model, "--dataset_name", "org/chat", "--dataset_config", "nope", *out], ["--dataset_name", "nope"]),
        ("good", ["pretokenize", "org/gated", str(base / "shards"), "--model_name_or_path", "org/tiny"], []),
    ]


def _failure_steps(base: Path, hub) -> list:
    return [["main", argv, {"HF_TOKEN": token}] for token, argv, _ in _failure_cases(base)]


def test_failures_are_one_line_naming_the_repository_the_flag_and_the_fix(runs):
    results, base = runs["failures"]
    for (_, argv, words), (rc, err, *_, seconds) in zip(_failure_cases(base), results, strict=True):
        lines = _one_line(err)  # huggingface_hub's warning of a card without metadata is not one of them
        if not words:  # the control: the right token passes the gate
            assert rc == 0, (argv, err[-2000:])
            continue
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (argv, err[-2000:])
        assert "--training_data_path" not in lines[0]
        for word in words:
            assert word in lines[0], (argv, lines[0])
        assert seconds < 60
    manifest = json.loads((base / "shards" / "pf_manifest.json").read_text())
    assert manifest["source"]["hub"]["repo_id"] == "org/gated"


@pytest.mark.parametrize("where", ["offline", "unreachable"])
def test_offline_with_nothing_cached_and_an_unreachable_hub_fail_in_one_line(hub, tmp_path, where):
    env = hub["server"].env(tmp_path / "hf", PF_TRL_CACHE=str(tmp_path / "pf"))
    if where == "offline":
        env["HF_HUB_OFFLINE"] = "1"
        words = ["--dataset_name org/chat", "HF_HUB_OFFLINE is set", "not in the Hub cache"]
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{closed_port()}"
        words = ["--dataset_name org/chat", "cannot be reached", "HF_ENDPOINT"]
    start = time.perf_counter()
    proc = run([PF_TRL, "train", "--model_name_or_path", "org/tiny", "--dataset_name", "org/chat", "--output_dir",
                str(tmp_path / "o")], env, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    assert time.perf_counter() - start < 60


@pytest.fixture(scope="module")
def service(hub):
    """One preprocessing service for every service test of this module: it may read org/chat, org/evil, org/fresh
    and the datasets around its download limit (LIMIT bytes), with its own Hub cache."""
    from test_service_support import Server

    root, server = hub["root"], hub["server"]
    online = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    started = Server(root / "service-cache", [], env={
        "HF_ENDPOINT": server.url, "HF_HUB_DISABLE_TELEMETRY": "1", **online,
        "PF_SERVICE_HUB_ALLOW": "org/chat,org/evil,org/fresh,org/large,org/unsized,org/medium,org/multi,org/multibig,"
                                "org/multiunsized",
        "PF_SERVICE_HUB_MAX_DOWNLOAD_BYTES": str(LIMIT)}).start()
    yield {"server": started, "hf": root / "service-cache" / "hf", "cache": root / "service-cache"}  # its HF_HOME
    started.stop()


def _events(client, dataset_id: str) -> list[dict]:
    """The job's events (its Server-Sent Events stream, read to its terminal event)."""
    with client.stream("GET", f"/v1/datasets/{dataset_id}/events", timeout=60) as r:
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


def test_service_builds_an_allowed_hub_dataset_and_refuses_any_other(hub, service):
    with service["server"].client() as client:
        body = {"source": {"hub": {"repo_id": "org/chat", "config": "short"}}}
        r = client.post("/v1/datasets", json=body)
        assert r.status_code == 202, r.text
        status = wait_state(client, r.json()["id"], timeout=180)
        assert status["state"] == "succeeded", status
        commit = status["manifest"]["source"]["hub"]["commit"]
        assert status["manifest"]["source"]["hub"]["repo_id"] == "org/chat"
        assert status["source"]["path"].startswith(f"hf://datasets/org/chat@{commit}/short/train.jsonl")
        downloads = [e for e in _events(client, r.json()["id"]) if e["kind"] == "downloading"]  # by the job
        assert downloads[0]["message"].startswith("downloading 1 file, ") and downloads[-1]["files_done"] == 1
        again = client.post("/v1/datasets", json=body)  # the same commit: the same dataset, no new job
        assert again.status_code == 200 and again.json()["id"] == r.json()["id"]
        # negative controls: a repository hub_allow does not name, and a URL instead of an id
        refused = client.post("/v1/datasets", json={"source": {"hub": {"repo_id": "org/gated"}}})
        assert refused.status_code == 403 and "org/gated is not a Hub dataset this service may read" in refused.text
        url = client.post("/v1/datasets", json={"source": {"hub": {"repo_id": "http://evil.example/x"}}})
        assert url.status_code == 422, url.text


def _cached_data(hf: Path, repo: str) -> list[str]:
    """The data a Hub cache holds of a dataset repository: its snapshot files and blobs beside the README's, and any
    partial download (huggingface_hub's own file listings, ``trees/``, hold no data)."""
    folder = hf / "hub" / f"datasets--{repo.replace('/', '--')}"
    readme = {p.resolve() for p in folder.glob("snapshots/*/README.md")}
    held = [*folder.glob("snapshots/**/*"), *folder.glob("blobs/*"), *folder.rglob("*.incomplete")]
    return sorted(str(p) for p in held if p.is_file() and p.name != "README.md" and p.resolve() not in readme)


def test_a_hub_source_over_the_download_limit_fails_its_job_in_one_line_and_leaves_nothing_cached(hub, service):
    """The job downloads a Hub source (the preflight only resolves it and reads its card), within the service's
    hub_max_download_bytes: over it, known from the Hub's sizes (org/large: nothing downloaded) or counted while
    downloading (org/unsized: the Hub tells no size), the job fails in one line naming the size, the limit and the
    setting, and the Hub cache keeps nothing of the data a next job would trust (the same POST fails again the same
    way). Control: org/medium, under the limit, is downloaded with its progress in the job's events, and built."""
    hf = service["hf"]
    with service["server"].client() as client:
        for repo, over in (("org/large", "are 3,"), ("org/unsized", "are over ")):
            for attempt in range(2):
                r = client.post("/v1/datasets", json={"source": {"hub": {"repo_id": repo}}})
                assert r.status_code == 202, r.text  # accepted at once: the size is the job's business
                status = wait_state(client, r.json()["id"], timeout=120)
                error = status["error"]
                assert status["state"] == "failed" and error["type"] == "too_large", status
                message = error["message"]
                assert "\n" not in message, message
                for word in (repo, over, f"{LIMIT:,} bytes", "hub_max_download_bytes",
                             "PF_SERVICE_HUB_MAX_DOWNLOAD_BYTES"):
                    assert word in message, (attempt, message)
                assert _cached_data(hf, repo) == [], (repo, attempt)
            kinds = [(e["kind"], e.get("message", "")) for e in _events(client, r.json()["id"])]
            downloading = [m for k, m in kinds if k == "downloading"]
            # known sizes: refused before any download; unknown: the download started, then was stopped
            assert downloading == ([] if repo == "org/large" else
                                   ["downloading 1 file, 0.0 MB known and 1 of unknown size"]), kinds
        r = client.post("/v1/datasets", json={"source": {"hub": {"repo_id": "org/medium"}}})
        assert r.status_code == 202, r.text
        status = wait_state(client, r.json()["id"], timeout=180)
        assert status["state"] == "succeeded", status["error"]
        assert status["manifest"]["counts"]["source_rows"] == 1200
        steps = [e for e in _events(client, r.json()["id"]) if e["kind"] == "downloading"]
        size = len(_text_rows(1200).encode())
        assert steps[0]["message"] == f"downloading 1 file, {size / 1e6:.1f} MB" and steps[0]["bytes_total"] == size
        assert steps[-1]["bytes_done"] == size and steps[-1]["files_done"] == 1, steps
        assert _cached_data(hf, "org/medium") != []
        # a mixture's Hub sources are downloaded by its job too, the limit holding for them together
        short, chat = {"hub": {"repo_id": "org/chat", "config": "short"}}, {"hub": {"repo_id": "org/chat"}}
        medium, large = {"hub": {"repo_id": "org/medium"}}, {"hub": {"repo_id": "org/large"}}
        for sources, state in (([short, chat], "succeeded"), ([medium, large], "failed")):
            r = client.post("/v1/mixtures", json={"sources": [{"source": source} for source in sources]})
            assert r.status_code == 202, r.text
            status = wait_state(client, r.json()["id"], timeout=180)
            assert status["state"] == state, status
            if state == "succeeded":
                rows = [source["counts"]["source_rows"] for source in status["manifest"]["sources"]]
                assert rows == [6, 12], status["manifest"]["sources"]
        assert status["error"]["type"] == "too_large" and "org/medium, org/large" in status["error"]["message"]


MULTI_API = r"""
import json, sys
import pf_trl
from pf_trl.errors import PfTrlError

manifest = pf_trl.pretokenize("org/multi", sys.argv[1] + "/api", progress=False)
try:  # the Ray engine tokenizes one file: refused in one line naming the engine that takes the split
    pf_trl.pretokenize("org/multi", sys.argv[1] + "/ray", engine="ray")
    ray = None
except PfTrlError as exc:
    ray = str(exc)
print("RESULT " + json.dumps({"sha256": manifest["source"]["sha256"], "rows": manifest["counts"]["source_rows"],
                              "ray": ray}))
"""


def _multi_steps(base: Path, hub) -> list:
    """`pf-trl pretokenize org/multi` (a train split of three files) and pf_trl.pretokenize of the same id."""
    return [["main", ["pretokenize", "org/multi", str(base / "cli"), "--no_progress"], {}],
            ["script", [MULTI_API, str(base)], {}]]


def _snapshot_files(hf: Path, repo: str) -> list[str]:
    folder = hf / "hub" / f"datasets--{repo.replace('/', '--')}"
    return sorted(p.relative_to(s).as_posix() for s in folder.glob("snapshots/*") for p in s.rglob("*") if p.is_file())


def _rows(path: str) -> list[list[list[int]]]:
    from pf_trl.data.shards import load_shards

    ds = load_shards(path)
    return [ds["input_ids"], ds["labels"]]


def test_a_hub_split_of_several_files_is_tokenized_by_the_service_as_the_cli_does(hub, service, runs):
    """org/multi's train split is three files (listed out of name order): the service downloads those three and
    nothing else (not the test split, not another configuration), shows each in the status, and writes the rows of
    `pf-trl pretokenize org/multi` token for token, with the same source identity; pf_trl.pretokenize takes the id
    the same way (the Ray engine refuses it in one line). Each file is checked: configurations naming `../x.jsonl`
    or a `.txt` file beside good files are refused in one line naming that file (control: the default configuration,
    good files only, is built). Over the download limit by the files together (each under it; sizes told, or not told
    and counted while downloading), the job fails in one line and nothing of the split stays cached."""
    import hashlib

    results, base = runs["multi"]
    (rc, err, _, _, _, fetched, _), (api_rc, api_err, said, *_) = results
    assert rc == 0, err[-3000:]
    assert fetched["datasets--org--multi"] == sorted(["README.md", *MULTI_TRAIN]), fetched
    assert api_rc == 0, api_err[-3000:]
    api = json.loads(said.split("RESULT ", 1)[1])
    cli = json.loads((base / "cli" / "pf_manifest.json").read_text())
    assert api["sha256"] == cli["source"]["sha256"] and api["rows"] == cli["counts"]["source_rows"] == 12, api
    assert _rows(str(base / "api")) == _rows(str(base / "cli"))
    assert "\n" not in api["ray"] and "3 files" in api["ray"] and "engine='local'" in api["ray"], api["ray"]
    with service["server"].client() as client:
        r = client.post("/v1/datasets", json={"source": {"hub": {"repo_id": "org/multi"}}})
        assert r.status_code == 202, r.text
        status = wait_state(client, r.json()["id"], timeout=180)
        assert status["state"] == "succeeded", status
        commit = hub["server"].repo_head("datasets", "org/multi")
        at = f"hf://datasets/org/multi@{commit}"
        assert status["source"]["path"] == at, status["source"]
        assert status["source"]["files"] == [f"{at}/{name}" for name in MULTI_TRAIN], status["source"]
        assert _snapshot_files(service["hf"], "org/multi") == sorted(["README.md", *MULTI_TRAIN])
        downloads = [e for e in _events(client, r.json()["id"]) if e["kind"] == "downloading"]
        assert downloads[0]["message"].startswith("downloading 3 files, ") and downloads[-1]["files_done"] == 3
        manifest = status["manifest"]
        assert _rows(status["shards_path"]) == _rows(str(base / "cli"))  # token for token, in the same order
        assert manifest["source"]["sha256"] == cli["source"]["sha256"], (manifest["source"], cli["source"])
        assert manifest["counts"] == cli["counts"]
        (record,), (cli_record,) = manifest["sources"], cli["sources"]
        assert record["name"] == cli_record["name"] == "multi-train"
        in_order = [hashlib.sha256(MULTI_FILES[name].encode()).hexdigest() for name in MULTI_TRAIN]
        assert record["source_sha256"] == cli_record["source_sha256"] == in_order
        assert record["data_paths"] == status["source"]["files"]
        # a mixture's Hub source of several files: the same concatenation, as one of its sources
        sources = [{"source": {"hub": {"repo_id": "org/multi"}}}, {"source": {"hub": {"repo_id": "org/chat",
                                                                                    "config": "short"}}}]
        mixed = client.post("/v1/mixtures", json={"sources": sources})
        assert mixed.status_code == 202, mixed.text
        mixed = wait_state(client, mixed.json()["id"], timeout=180)
        assert mixed["state"] == "succeeded", mixed
        parts = mixed["manifest"]["sources"]
        assert [p["counts"]["source_rows"] for p in parts] == [12, 6] and parts[0]["data_paths"] == record["data_paths"]
        cli_ids = _rows(str(base / "cli"))[0]
        assert _rows(mixed["shards_path"])[0][:len(cli_ids)] == cli_ids
        for config, word in (("up", "'../x.jsonl'"), ("odd", "data/notes.txt")):
            refused = client.post("/v1/datasets", json={"source": {"hub": {"repo_id": "org/multi", "config": config}}})
            detail = refused.json()["detail"]
            assert refused.status_code == 422 and word in detail and "\n" not in detail, refused.text
        assert _snapshot_files(service["hf"], "org/multi") == sorted(["README.md", *MULTI_TRAIN])
        size = sum(len(text.encode()) for text in MULTI_HALVES.values())
        for repo, over in (("org/multibig", f"are {size:,} bytes"), ("org/multiunsized", "are over ")):
            r = client.post("/v1/datasets", json={"source": {"hub": {"repo_id": repo}}})
            assert r.status_code == 202, r.text
            status = wait_state(client, r.json()["id"], timeout=120)
            assert status["state"] == "failed" and status["error"]["type"] == "too_large", status
            message = status["error"]["message"]
            assert "\n" not in message and repo in message and "2 file(s)" in message and over in message, message
            assert f"{LIMIT:,} bytes" in message and _cached_data(service["hf"], repo) == [], (repo, message)
            assert len(status["source"]["files"]) == 2, status["source"]


API = r"""
import json, sys
from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

def losses(model, data, out, **init):
    args = PaddingFreeConfig(output_dir=out, max_steps=2, logging_steps=1, max_tokens_per_batch=64, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, model_init_kwargs=init or None)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=data)
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]

hub = losses("org/tiny", "org/chat", sys.argv[1] + "/hub", revision="v1")
local = losses(sys.argv[2], sys.argv[3], sys.argv[1] + "/local")
print("RESULT " + json.dumps([hub, local]))
"""


def _api_steps(base: Path, hub) -> list:
    """The Python API's Hub tests: the trainer from Hub ids (API), then pretokenize while main moves (RACING, last:
    it wraps HfApi.repo_info for the rest of the process)."""
    return [["script", [API + RACING, str(base), str(hub["model"]), str(hub["data"] / "data" / "train.jsonl"),
                        str(hub["server"].repo("datasets", "org/racing"))], {}]]


@pytest.fixture(scope="module")
def python_api(runs):
    """The RESULT lines of the Python API's script (:func:`_api_steps`)."""
    ((rc, err, said, *_),), _ = runs["api"]
    assert rc == 0, err[-3000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in said.splitlines() if line.startswith("RESULT ")]


def test_python_api_takes_hub_ids_as_model_and_train_dataset(python_api):
    from_hub, local = python_api[0]
    assert len(from_hub) == 2
    assert_bit_equal(from_hub, local, why=SAME_FILES)


RACING = r"""
import subprocess
from huggingface_hub import HfApi
import pf_trl
from pf_trl.data.local_datasets import dataset_splits
from pf_trl.hub import one_commit_per_repository, origin_of

mirror, out = sys.argv[4], sys.argv[1] + "/racing"
real, first, move = HfApi.repo_info, [], [True]

def repo_info(self, repo_id, *args, **kwargs):  # main of org/racing moves right after a call first resolves it
    info = real(self, repo_id, *args, **kwargs)
    if repo_id == "org/racing" and move[0]:
        move[0] = False
        first.append(info.sha)
        rows = "".join(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                   "content": "a"}]}) + "\n" for _ in range(3 + 3 * len(first)))
        with open(mirror + "/data/train.jsonl", "a") as fh:
            fh.write(rows)
        git = ["git", "-C", mirror, "-c", "user.name=t", "-c", "user.email=t"]
        subprocess.run(git + ["commit", "-qam", "moved"], check=True)
    return info

HfApi.repo_info = repo_info
manifest = pf_trl.pretokenize("org/racing", out, tokenizer="org/tiny", progress=False)
api = [first[-1], manifest["source"]["hub"]["commit"], manifest["counts"]["source_rows"]]
move[0] = True  # control: the same read outside a block, main moving again
read = origin_of(dataset_splits("org/racing", splits=["train"])["train"][0]).commit
bare = [first[-1], read]
move[0] = True
with one_commit_per_repository():
    read = origin_of(dataset_splits("org/racing", splits=["train"])["train"][0]).commit
pinned = [first[-1], read]
print("RESULT " + json.dumps({"api": api, "bare": bare, "pinned": pinned}))
"""


def test_python_pretokenize_reads_a_hub_dataset_at_the_one_commit_it_resolved(python_api):
    """pf_trl.pretokenize("ORG/NAME") (a Hub dataset id, as `pf-trl pretokenize` takes it) reads the card and the
    data of the commit it resolved first, though main moves right after: the manifest names that commit and its 6
    rows. Control: the same resolution outside a one_commit_per_repository block (what the call was missing) reads
    the data of the moved main, a commit other than the one it resolved; inside one, the resolved commit."""
    found = python_api[1]
    resolved, commit, rows = found["api"]
    assert commit == resolved and rows == 6, found
    assert found["bare"][0] != found["bare"][1], found  # the control: two commits in one read
    assert found["pinned"][0] == found["pinned"][1], found


# Each step in one process, in order: pf-trl's commands (main), the Python API, the model card's snippet, a
# script of its own, or the Hub server's access rules; each with its own environment variables on top of the
# process's (HF_TOKEN, PF_TRL_CACHE: read when used) and the process's working folder. After each: what it returned
# and said, the files of org/custom in the Hub cache (what was downloaded), the files of every repository's
# snapshots, its seconds.
STEPS = r"""
import contextlib, io, json, logging, os, sys, time
from pathlib import Path
hub = Path(os.environ["HF_HOME"]) / "hub"
sys.path.insert(0, sys.argv[2])  # tests/: the test session's shortcuts of upstream bookkeeping, for these runs too
from upstream_shortcuts import install
install()

def downloaded():
    return sorted(p.name for p in hub.glob("models--org--custom/snapshots/*/*"))

def fetched():
    out = {}
    for snap in hub.glob("*--*/snapshots/*"):
        out.setdefault(snap.parent.parent.name, []).extend(
            p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())
    return {k: sorted(v) for k, v in out.items()}

def api(model, trust, out):
    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer
    args = PaddingFreeConfig(output_dir=out, max_steps=2, logging_steps=1, max_tokens_per_batch=64, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, trust_remote_code=trust)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset="org/chat")
    trainer.train()
    return [type(trainer.model).__module__, [r["loss"] for r in trainer.state.log_history if "loss" in r]]

def card(folder, trusted):
    # the model card's "Use" snippet, run from the folder it names the model from (the output folder's parent)
    import re
    text = (Path(folder) / "README.md").read_text().split("## Use", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    if not trusted:
        snippet = snippet.replace(", trust_remote_code=True", "")
    os.chdir(Path(folder).parent)
    scope = {}
    exec(snippet, scope)
    return [type(scope["model"]).__module__, type(scope["tokenizer"]).__name__, snippet]

def rules(path, new):  # what the rules were (what the steps before left of them), then the new ones
    old = json.loads(Path(path).read_text())
    Path(path).write_text(json.dumps(new))
    return old

out = []
for kind, argv, env in json.loads(sys.argv[1]):
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    err, std = io.StringIO(), io.StringIO()
    logging.getLogger().handlers.clear()  # each command's logging.basicConfig writes to this step's stderr
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        if kind == "main":
            from pf_trl.cli.main import main
            rc, result = main(argv), None
        elif kind == "rules":
            rc, result = 0, rules(*argv)
        elif kind == "script":  # a script of its own, given its arguments; what it prints is the step's stdout
            sys.argv = ["-c", *argv[1:]]
            exec(argv[0], {"__name__": "__main__"})
            rc, result = 0, None
        elif kind == "card":
            try:
                rc, result = 0, card(*argv)
            except ValueError as exc:  # transformers' refusal of custom code it was not allowed to run
                rc, result = 2, str(exc)
        else:
            from pf_trl.errors import PfTrlError
            try:
                rc, result = 0, api(*argv)
            except PfTrlError as exc:
                rc, result = 2, str(exc)
    seconds = time.perf_counter() - start
    os.environ.clear()
    os.environ.update(saved_env)
    os.chdir(saved_cwd)
    out.append([rc, err.getvalue(), std.getvalue(), downloaded(), result, fetched(), seconds])
print("RESULT " + json.dumps(out))
"""

# The groups of steps of the shared process, in its order (only-what-a-run-reads first: the Hub cache still empty).
GROUPS = {"fetched": "_fetched_steps", "ids": "_ids_steps", "dpo": "_dpo_steps", "custom": "_custom_steps",
          "failures": "_failure_steps", "evil": "_evil_steps", "identity": "_identity_steps", "api": "_api_steps",
          "multi": "_multi_steps"}


@pytest.fixture(scope="module")
def runs(hub, tmp_path_factory):
    """The CLI's and the Python API's Hub runs of several tests in one process (one interpreter start with torch,
    transformers and TRL, 5-10 CPU-s, instead of one per test; tests/upstream_shortcuts.py installed as in the test
    session): one Hub cache (HF_HOME), a pf-trl cache and a folder per test (its group); each
    test checks its group's results (:data:`STEPS`' rows) and files. Tests whose claim needs a process environment
    of its own (offline, another endpoint, an unwritable cache, a fresh process reading a cache) keep theirs."""
    root = tmp_path_factory.mktemp("runs")
    bases = {name: root / name for name in GROUPS}
    steps, spans = [], {}
    for name, make in GROUPS.items():
        group = [[kind, argv, {"PF_TRL_CACHE": str(bases[name] / "pf"), **env}]
                 for kind, argv, env in globals()[make](bases[name], hub)]
        spans[name] = slice(len(steps), len(steps) + len(group))
        steps += group
    env = hub["server"].env(root / "hf")
    proc = run([sys.executable, "-c", STEPS, json.dumps(steps), str(Path(__file__).parent)], env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULT ", 1)[1])
    return {"root": root, "env": env, **{name: (results[span], bases[name]) for name, span in spans.items()}}


_PY_WARNING = re.compile(r"^\S+\.py:\d+: \w+Warning: |^\s+warnings\.warn\(")


def _one_line(err: str) -> list[str]:
    """What a command said on stderr, less progress bars and upstream's Python / transformers warnings."""
    return [ln for ln in err.splitlines() if ln.strip() and "it/s]" not in ln and "%|" not in ln
            and not ln.startswith("[transformers]") and not _PY_WARNING.search(ln)]


def _state_losses(out: Path) -> list[float]:
    state = json.loads(next(out.glob("checkpoint-*/trainer_state.json")).read_text())
    return [row["loss"] for row in state["log_history"] if "loss" in row]


def _custom_steps(base: Path, hub) -> list:
    data = ["--dataset_name", "org/chat", "--max_steps", "3", "--logging_steps", "1", "--max_tokens_per_batch", "64",
            "--seed", "0", "--report_to", "none"]
    trust = ["--trust_remote_code", "True"]
    shards = str(base / "shards")
    steps = [
        ["main", ["train", "--model_name_or_path", "org/custom", *data, "--output_dir", str(base / "a")]],
        ["main", ["train", "--model_name_or_path", str(hub["custom"]), *data, "--output_dir", str(base / "b")]],
        ["main", ["dpo", "--model_name_or_path", "org/custom", "--dataset_name", "org/pairs", "--output_dir",
                  str(base / "c"), "--report_to", "none", "--use_cpu", "true"]],
        ["api", ["org/custom", False, str(base / "d")]],
        ["main", ["train", "--model_name_or_path", "org/custom", *data, *trust, "--output_dir", str(base / "hub")]],
        ["main", ["train", "--model_name_or_path", str(hub["custom"]), *data, *trust, "--output_dir",
                  str(base / "local")]],
        ["api", ["org/custom", True, str(base / "e")]],
        ["card", [str(base / "hub"), True]],
        ["card", [str(base / "hub"), False]],
        ["main", ["pretokenize", "org/chat", shards, "--model_name_or_path", "org/custom", "--no_progress"]],
        ["main", ["pretokenize", "org/chat", shards, "--model_name_or_path", "org/custom", "--no_progress", *trust]],
        ["main", ["inspect", shards, "--samples", "1"]],
        ["main", ["inspect", shards, "--samples", "1", *trust]],
    ]
    return [[kind, argv, {}] for kind, argv in steps]


def test_custom_code_model_needs_trust_remote_code_and_is_self_checked(hub, runs):
    """A model of its own code (config.json auto_map, a model_type transformers does not ship), from the Hub and from
    a local folder: refused in one line without --trust_remote_code True, having downloaded its config.json and
    nothing else; with it the custom classes load and train (the runtime self-check decides, said in a warning),
    from the Hub to the local folder's losses; the same for the Python API, pretokenize and inspect (the tokenizer's
    own code)."""
    results, base = runs["custom"]
    steps = _custom_steps(base, hub)
    # refused: one line naming the flag and the custom class, having downloaded config.json alone
    for i, (rc, err, _, files, *_) in enumerate(results[:4]):
        lines = _one_line(err) if i < 3 else [results[i][4]]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (steps[i], err[-2000:])
        switch = "--trust_remote_code True" if i < 3 else "model org/custom: "  # the API: its config's field
        for word in (switch, "trust_remote_code", "modeling_custom.CustomLlamaForCausalLM", "runtime self-check"):
            assert word in lines[0], (steps[i], lines[0])
        assert files == ["config.json"], (steps[i], files)  # no weights, no code: the refusal came first
    assert "--model_name_or_path org/custom" in _one_line(results[0][1])[0]
    assert f"--model_name_or_path {hub['custom']}" in _one_line(results[1][1])[0]
    # trusted: the custom class trains, self-checked (said), from the Hub exactly as from the local folder
    for rc, err, std, *_ in results[4:6]:
        assert rc == 0, err[-3000:]
        assert "CustomLlamaForCausalLM comes from custom code" in err + std and "self-check decides" in err + std
    assert {"model.safetensors", "modeling_custom.py", "tokenization_custom.py"} <= set(results[4][3])
    from_hub, local = _state_losses(base / "hub"), _state_losses(base / "local")
    assert len(from_hub) == 3
    assert_bit_equal(from_hub, local, why=SAME_FILES)
    module, api_losses = results[6][4]
    assert results[6][0] == 0 and module.startswith("transformers_modules.") and len(api_losses) == 2
    # the model card's snippet loads the saved custom classes (it asks for their code); without asking it cannot
    assert results[7][0] == 0, results[7][1][-2000:]
    module, tokenizer, snippet = results[7][4]
    assert module.startswith("transformers_modules.") and tokenizer == "CustomTokenizer", snippet
    assert results[8][0] == 2 and "trust_remote_code" in results[8][4]
    # the tokenizer's own code: pretokenize and inspect refuse it in one line without the flag, run it with it
    for refused, allowed in ((results[9], results[10]), (results[11], results[12])):
        lines = _one_line(refused[1])
        assert refused[0] == 2 and len(lines) == 1 and "--trust_remote_code True" in lines[0], refused[1][-2000:]
        assert "tokenizer" in lines[0]
        assert allowed[0] == 0, allowed[1][-2000:]
    assert "supervised tokens are shown" in results[12][2]


def _dpo_steps(base: Path, hub) -> list:
    common = ["--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "2", "--seed", "0",
              "--report_to", "none", "--save_steps", "2", "--use_cpu", "true", "--disable_tqdm", "true"]

    def dpo(out: str, *args: str) -> list:
        return ["main", ["dpo", *args, *common, "--output_dir", str(base / out)], {}]

    return [
        dpo("hub", "--model_name_or_path", "org/tiny", "--model_revision", "v1", "--dataset_name", "org/pairs"),
        dpo("local", "--model_name_or_path", str(hub["model"]), "--dataset_name", str(hub["pairs"])),
        dpo("x", "--model_name_or_path", "org/tiny", "--model_revision", "v9", "--dataset_name", "org/pairs"),
        dpo("x", "--model_name_or_path", "org/tiny", "--dataset_name", "org/nothing"),
        dpo("x", "--model_name_or_path", str(hub["model"]), "--model_revision", "v1", "--dataset_name", "org/pairs"),
        dpo("x", "--model_name_or_path", "org/tiny", "--dataset_name", "org/pairs", "--dataset_streaming", "True"),
    ]


def test_dpo_takes_hub_ids_through_the_same_hub_code_as_train(runs):
    """`pf-trl dpo` with a Hub model at a revision and a Hub dataset trains to the losses of the same run from local
    copies; its Hub failures, and streaming, are one line (exit 2)."""
    results, base = runs["dpo"]
    for rc, err, *_ in results[:2]:
        assert rc == 0, err[-3000:]
    from_hub, local = _state_losses(base / "hub"), _state_losses(base / "local")
    assert len(from_hub) == 2
    assert_bit_equal(from_hub, local, why=SAME_FILES)
    words = [["--model_name_or_path org/tiny (revision v9)", "no revision 'v9'"],
             ["--dataset_name org/nothing", "no dataset repository"],
             ["--model_revision v1", "not a Hub id"],
             ["--dataset_streaming True", "not supported by pf-trl dpo"]]
    for (rc, err, *_), expected in zip(results[2:], words):
        lines = _one_line(err)
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        for word in expected:
            assert word in lines[0], lines[0]


def test_a_shipped_model_type_with_an_auto_map_loads_as_transformers_loads_it(tmp_path):
    """A config whose auto_map names code of its own for a model_type transformers ships (older Hub repositories of
    shipped architectures carry one): without --trust_remote_code transformers' own class loads, as transformers and
    trl sft load it; with it, the repository's code runs. Control: the same folder with a type transformers does not
    ship is refused without the flag."""
    from pf_trl.models import build_model
    from pf_trl.remote_code import RemoteCodeError, custom_code

    custom = _custom_code_model(tmp_path / "custom")
    shipped = tmp_path / "shipped"
    shutil.copytree(custom, shipped)
    config = json.loads((shipped / "config.json").read_text())
    (shipped / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert custom_code(shipped) is None
    assert type(build_model(str(shipped))).__module__.startswith("transformers.models.llama.")
    assert type(build_model(str(shipped), trust_remote_code=True)).__module__.startswith("transformers_modules.")
    assert custom_code(custom) == "modeling_custom.CustomLlamaForCausalLM"
    with pytest.raises(RemoteCodeError, match="--trust_remote_code True"):
        build_model(str(custom))


def _fetched_steps(base: Path, hub) -> list:
    """The first steps of the shared process: the Hub cache is still empty."""
    train = ["train", "--model_name_or_path", "org/big", "--dataset_name", "org/chat", "--dataset_config", "short",
             "--max_steps", "1", "--max_tokens_per_batch", "64", "--report_to", "none", "--save_strategy", "no",
             "--output_dir", str(base / "out")]
    return [["main", ["pretokenize", "org/chat", str(base / "shards"), "--model_name_or_path", "org/big",
                      "--no_progress"], {}], ["main", train, {}]]


def test_only_what_a_run_reads_is_fetched(hub, runs):
    """A tokenizer-only pretokenize fetches no weight file; training fetches the index and the shards it names, the
    config and generation config, the tokenizer, and nothing else of the repository (no consolidated.safetensors, no
    checkpoint-1/ or awq/ folder); a dataset's configuration brings its own split's files only."""
    results = [(rc, err, fetched) for rc, err, _, _, _, fetched, _ in runs["fetched"][0]]
    for rc, err, _ in results:
        assert rc == 0, err[-3000:]
    repo = {p.relative_to(hub["server"].repo("models", "org/big")).as_posix()
            for p in hub["server"].repo("models", "org/big").rglob("*") if p.is_file() and ".git" not in p.parts}
    index = json.loads((hub["big"] / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    # negative control: the repository does hold the strays, and the weights are in several shards
    assert {"consolidated.safetensors", "checkpoint-1/model.safetensors", "awq/config.json"} <= repo
    assert len(shards) >= 2
    tokenizer_only = set(results[0][2]["models--org--big"])
    assert not any(name.endswith(".safetensors") for name in tokenizer_only), tokenizer_only
    assert {"tokenizer_config.json", "tokenizer.json"} <= tokenizer_only and not any("/" in n for n in tokenizer_only)
    assert results[0][2]["datasets--org--chat"] == ["README.md", "data/train.jsonl"]  # not test.jsonl, not short/
    trained = set(results[1][2]["models--org--big"])
    assert trained == tokenizer_only | shards | {"model.safetensors.index.json", "config.json",
                                                 "generation_config.json"}, trained ^ repo
    assert results[1][2]["datasets--org--chat"] == ["README.md", "data/train.jsonl", "short/train.jsonl"]


def _files_holding(root: Path, marker: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and marker in p.read_bytes()]


def _evil_cases(base: Path, hub) -> list:
    """(argv, words of the one line) of org/evil's configurations."""
    leak, tiny = str(hub["leak"]), ["--model_name_or_path", "org/tiny"]
    return [
        (["pretokenize", "org/evil", str(base / "s1"), *tiny], [leak, "an absolute path"]),
        (["train", *tiny, "--dataset_name", "org/evil", "--dataset_config", "up", "--output_dir", str(base / "o")],
         ["../../", "climbs out", "configuration 'up'"]),
        (["train", *tiny, "--dataset_name", "org/evil", "--dataset_config", "url", "--output_dir", str(base / "o")],
         ["http://127.0.0.1:", "a URL"]),
    ]


def _evil_steps(base: Path, hub) -> list:
    return [["main", argv, {}] for argv, _ in _evil_cases(base, hub)]


def test_a_dataset_card_pointing_outside_its_repository_is_refused_and_a_service_follows_main(hub, service, runs,
                                                                                              tmp_path):
    """org/evil's card names an absolute path, a `..` path and a URL to another host: the CLI and the service refuse
    each in one line naming the file, and nothing of the outside file lands in any cache or shard. The service reads
    branches and tags only (refs/pr/N and commits refused by default), and a long-lived service follows `main`: a new
    commit is tokenized anew, the same commit is a cache hit."""
    from pf_trl.data.local_datasets import dataset_splits

    server, leak = hub["server"], str(hub["leak"])
    # negative control: read as a local folder (the user's own data, as datasets resolves a card), the card does
    # resolve to the outside file
    local = tmp_path / "evil-local"
    shutil.copytree(server.repo("datasets", "org/evil"), local, ignore=shutil.ignore_patterns(".git"))
    assert dataset_splits(str(local))["train"] == [leak]
    results, base = runs["evil"]
    for (argv, words), (rc, err, *_) in zip(_evil_cases(base, hub), results, strict=True):
        lines = _one_line(err)
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (argv, err[-2000:])
        for word in ["org/evil", "outside the repository", *words]:
            assert word in lines[0], (argv, lines[0])
    with service["server"].client() as client:
        for config, word in ((None, leak), ("up", "../../"), ("url", "http://127.0.0.1:")):
            body = {"source": {"hub": {"repo_id": "org/evil", "revision": "main",
                                       **({"config": config} if config else {})}}}
            r = client.post("/v1/datasets", json=body)
            assert r.status_code == 422 and word in r.text and "outside the repository" in r.text, r.text
        fresh = {"source": {"hub": {"repo_id": "org/fresh"}}}
        for revision in ("refs/pr/1", "a" * 40):  # a pull request, a commit: not what the settings allow
            body = {"source": {"hub": {"repo_id": "org/fresh", "revision": revision}}}
            r = client.post("/v1/datasets", json=body)
            assert r.status_code == 403 and "hub_revisions: names" in r.text, r.text
        first = client.post("/v1/datasets", json=fresh)
        assert first.status_code == 202, first.text
        done = wait_state(client, first.json()["id"], timeout=180)
        assert done["state"] == "succeeded", done
        server.commit("datasets", "org/fresh", {"data/train.jsonl": _chat(8, "f")}, "two rows more")
        second = client.post("/v1/datasets", json=fresh)  # the same process, main has moved
        assert second.status_code == 202 and second.json()["id"] != first.json()["id"], second.text
        moved = wait_state(client, second.json()["id"], timeout=180)
        assert moved["state"] == "succeeded", moved
        commits = [s["manifest"]["source"]["hub"]["commit"] for s in (done, moved)]
        assert commits[0] != commits[1] and commits[1] == server.repo_head("datasets", "org/fresh")
        again = client.post("/v1/datasets", json=fresh)  # the same commit: the same dataset, no new job
        assert again.status_code == 200 and again.json()["id"] == second.json()["id"], again.text
    assert _files_holding(tmp_path, SECRET.encode()) == []
    assert _files_holding(runs["root"], SECRET.encode()) == []  # the CLI's Hub cache and pf-trl cache
    assert _files_holding(service["cache"], SECRET.encode()) == []  # its Hub cache (HF_HOME) included


def test_a_hub_cache_that_cannot_be_written_is_named_not_taken_for_a_missing_file(hub, tmp_path):
    """HF_HUB_CACHE on a filesystem that refuses writes (/sys, even for root): one line naming the cache and the
    disk's error, not "not in the Hub cache" nor the Hub's answer. Control: offline with the same unreadable cache, the
    model is truly not cached, and that is what the line says."""
    unwritable = "/sys/pf-trl-hub-cache"
    env = hub["server"].env(tmp_path / "hf", PF_TRL_CACHE=str(tmp_path / "pf"), HF_HUB_CACHE=unwritable)
    argv = [PF_TRL, "pretokenize", "org/chat", str(tmp_path / "s"), "--model_name_or_path", "org/tiny", "--no_progress"]
    for offline, words in ((False, ["source org/chat", "the Hub cache cannot be written or read", unwritable,
                                    "Operation not permitted", "HF_HOME"]),  # (no revision was given)
                           (True, ["source org/chat", "HF_HUB_OFFLINE is set", "not in the Hub cache"])):
        proc = run(argv, {**env, "HF_HUB_OFFLINE": "1"} if offline else env, timeout=120)
        # (huggingface_hub's own warning that it could not keep its file listing, before the refusal)
        lines = [ln for ln in _one_line(proc.stderr) if not ln.startswith("Ignored error while writing tree cache")]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        for word in words:
            assert word in lines[0], lines[0]
        assert "(revision" not in lines[0], lines[0]  # none was given: the resolved commit is not shown as one
