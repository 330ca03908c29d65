"""The service takes what the CLI takes: a chat template (and every other data option) in the request's `options`,
from the one declaration of the data options; its 422 names the request field, never a CLI flag; the dataset it
builds is refused for a model whose tokenizer renders chats differently, naming the chat template."""

from __future__ import annotations

import copy

import pytest

from test_service_support import Server, wait_state, write_rows

pytestmark = pytest.mark.slow
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
            "{% else %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def service(tmp_path_factory, tokenizer):
    base = tmp_path_factory.mktemp("svc-options")
    root = base / "data"
    root.mkdir()
    plain = copy.copy(tokenizer)
    plain.chat_template = None  # a model folder without a chat template (Gemma 3 base, for one)
    plain.save_pretrained(root / "plain-tok")
    write_rows(root / "chat.jsonl", [{"conversations": [{"from": "human", "value": f"Hi {i}"},
                                                        {"from": "gpt", "value": f"Hello {i}."}]} for i in range(30)])
    server = Server(base / "cache", [root]).start()
    yield server, root
    server.stop()


def test_chat_template_in_the_request(service):
    from pf_trl.data import sources
    from pf_trl.data.tokenizer import load_tokenizer

    server, root = service
    body = {"source": {"path": "chat.jsonl"}, "tokenizer": str(root / "plain-tok")}
    with server.client() as c:
        r = c.post("/v1/datasets", json=body)
        assert r.status_code == 422, r.text
        problem = r.json()
        assert [e["field"] for e in problem["errors"]] == ["options.chat_template"]
        assert "options.chat_template (the template text)" in problem["detail"] and "--" not in problem["detail"]

        bad = c.post("/v1/datasets", json={**body, "options": {"chat_template": "no jinja here"}})
        assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "options.chat_template"
        assert "not a Jinja template" in bad.json()["detail"]

        r = c.post("/v1/datasets", json={**body, "options": {"chat_template": TEMPLATE, "max_seq_len": 64}})
        assert r.status_code == 202, r.text
        done = wait_state(c, r.json()["id"])
    assert done["state"] == "succeeded", done
    manifest = done["manifest"]
    assert manifest["options"]["chat_template"] == TEMPLATE and manifest["tokenizer"]["chat_template_sha256"]

    model_tok = load_tokenizer(str(root / "plain-tok"))  # the model's own tokenizer: no template
    with pytest.raises(sources.DataSourceError, match="chat template differs"):
        sources.load_service_dataset(server.url, done["id"], model_tok, progress=False)
    model_tok.chat_template = TEMPLATE  # what `--chat_template FILE` does for the trainer
    ds = sources.load_service_dataset(server.url, done["id"], model_tok, progress=False)
    assert ds.num_rows == 30 and model_tok.decode(ds[0]["input_ids"]).startswith("<s>[INST] Hi 0 [/INST] Hello 0.")
