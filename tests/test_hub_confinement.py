"""What a Hub dataset card may name, and which revisions the service reads: the checks themselves, on real README
files and the service's real settings (tests/test_hub.py runs them end to end against a Hub server)."""

from __future__ import annotations

import pytest

from pf_trl.data.hub_datasets import HubDatasetError, check_card, check_inside, outside_reason

CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.jsonl
- config_name: other
  data_files:
  - split: train
    path: {bad}
---
"""


@pytest.mark.parametrize("bad, reason", [
    ("/etc/passwd", "an absolute path"), ("~/secret.jsonl", "an absolute path"),
    ("C:\\\\data\\\\x.jsonl", "an absolute path"),
    ("../other/train.jsonl", "climbs out"), ("data/../../x.jsonl", "climbs out"),
    ("https://example.invalid/x.jsonl", "a URL"), ("zip://x.jsonl::data/a.zip", "a URL"),
    ("hf://datasets/other/repo/x.jsonl", "a URL"),
])
def test_a_card_naming_a_file_outside_its_repository_is_refused_naming_it(tmp_path, bad, reason):
    readme = tmp_path / "README.md"
    readme.write_text(CARD.format(bad=bad), encoding="utf-8")
    with pytest.raises(HubDatasetError, match="outside the repository") as info:
        check_card(readme, "org/x", "--dataset_name", config="other")
    line = str(info.value)
    assert "\n" not in line and reason in line and "'other'" in line and "--dataset_name org/x" in line
    check_card(readme, "org/x", "--dataset_name")  # control: the default configuration is inside


def test_the_callers_own_data_files_are_checked_too(tmp_path):
    with pytest.raises(HubDatasetError, match="data_dir"):
        check_card(None, "org/x", "datasets[0] path", data_dir="../elsewhere")
    with pytest.raises(HubDatasetError, match="a URL"):
        check_card(None, "org/x", "datasets[0] path", data_files={"train": ["http://h/x.jsonl"]})
    check_card(None, "org/x", "datasets[0] path", data_dir="sub", data_files={"train": "sub/a.jsonl"})


def test_inside_paths_pass_and_the_rest_is_named():
    for good in ("data/train.jsonl", "a/b/c-*.parquet", "train.jsonl", "x..y.jsonl"):
        assert outside_reason(good) is None, good


def test_an_offline_snapshot_file_outside_the_folder_or_linked_out_is_refused(tmp_path):
    repo = tmp_path / "datasets--org--x"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "blobs" / "b1").write_text("{}\n")
    (snap / "train.jsonl").symlink_to(repo / "blobs" / "b1")  # huggingface_hub's own layout: inside
    check_inside({"train": [str(snap / "train.jsonl")]}, snap, "org/x", "--dataset_name")
    outside = tmp_path / "outside.jsonl"
    outside.write_text("{}\n")
    (snap / "linked.jsonl").symlink_to(outside)
    for files in ({"train": [str(outside)]}, {"train": [str(snap / ".." / ".." / ".." / "outside.jsonl")]},
                  {"train": [str(snap / "linked.jsonl")]}):
        with pytest.raises(HubDatasetError, match="outside the repository's snapshot"):
            check_inside(files, snap, "org/x", "--dataset_name")


def test_the_service_reads_branches_and_tags_unless_its_settings_allow_more(tmp_path):
    from preprocess_service.settings import Settings, SettingsError, hub_revision_kind

    assert [hub_revision_kind(r) for r in (None, "main", "v1.0", "refs/pr/3", "refs%2Fpr%2F3", "a" * 40, "abc1234",
                                           "refs/convert/parquet")] == \
        ["names", "names", "names", "pull-requests", "pull-requests", "commits", "commits", "other"]
    assert hub_revision_kind("dev", commit="0" * 40) == "names"  # a name the commit does not start with
    assert hub_revision_kind("beef", commit="beef" + "0" * 36) == "commits"  # a short hash spelled as a name
    default = Settings(cache_dir=tmp_path / "c")
    assert default.hub_revisions == ["names"]
    assert default.hub_revision_refusal("main") is None and default.hub_revision_refusal(None) is None
    refusal = default.hub_revision_refusal("refs/pr/1")
    assert refusal and "pull request" in refusal and "--hub-revisions" in refusal and "\n" not in refusal
    assert default.hub_revision_refusal("a" * 40)
    assert default.hub_revision_refusal("refs/convert/parquet")
    wider = Settings.load(env={"PF_SERVICE_CACHE_DIR": str(tmp_path / "c"),
                               "PF_SERVICE_HUB_REVISIONS": "names,pull-requests"})
    assert wider.hub_revision_refusal("refs/pr/1") is None and wider.hub_revision_refusal("a" * 40)
    with pytest.raises(SettingsError, match="hub_revisions branches"):
        Settings(cache_dir=tmp_path / "c", hub_revisions=["branches"])


def test_a_commit_block_inside_another_keeps_the_outer_commits():
    """`pf-trl pretokenize` runs in a block and calls pf_trl.pretokenize, which opens its own: the inner block must
    share the outer one's pins (a fresh inner block would resolve the revisions again, at a moved branch)."""
    from pf_trl import hub

    assert hub._pins() is None
    with hub.one_commit_per_repository():
        outer = hub._pins()
        outer[("dataset", "org/x", None)] = hub.Resolved(commit="a" * 40, files=())
        with hub.one_commit_per_repository():
            assert hub._pins() is outer
            assert hub.resolve("org/x", repo_type="dataset", flag="f").commit == "a" * 40  # no Hub asked
        assert hub._pins() is outer
    assert hub._pins() is None
