"""Vision-language models padding-free: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (3-D mRoPE) and Gemma 3 (multimodal).

Tiny models and their processors are built offline (:mod:`pf_trl_dev.tiny_vlm`: each family's processor class,
a small PIL image processor, the Mistral v1 tokenizer + the family's image tokens, TRL's copy of the family's chat
template). The reference is TRL's own padded vision-language run: ``SFTTrainer`` with its
``DataCollatorForVisionLanguageModeling`` (``assistant_only_loss=True``, the loss pf-trl puts on chat rows), whose
``compute_loss`` and gradients ``PaddingFreeSFTTrainer`` must reproduce on one packed row built by its own data path
(pretokenize -> shards with images -> sampler -> collator). Negative controls: rotary positions not restarted per
example, images moved to another example, and (Gemma 3) transformers' own packed mask without pf-trl's.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from pf_trl_dev.tiny_vlm import random_images, tiny_processor, tiny_vlm

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3")
CASES = [(f, m) for f in FAMILIES for m in ("huggingface", "internal") if (f, m) != ("gemma3", "internal")]
LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def chat_rows(seed: int = 1) -> list[dict]:
    """Four conversations with 1, 0, 2 and 3 images (varied sizes), one of them multi-turn."""
    imgs = random_images(6, seed=seed)
    return [
        {"messages": [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": "A cat on a mat."}],
         "images": [imgs[0]]},
        {"messages": [{"role": "user", "content": "Hi there, how are you"},
                      {"role": "assistant", "content": "Hello there."}], "images": []},
        {"messages": [{"role": "user", "content": "Compare"}, {"role": "assistant", "content": "They differ a lot."}],
         "images": [imgs[1], imgs[2]]},
        {"messages": [{"role": "user", "content": "Three?"}, {"role": "assistant", "content": "Yes three images."},
                      {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Sure."}],
         "images": [imgs[3], imgs[4], imgs[5]]},
    ]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_error(test: dict, ref: dict) -> float:
    worst = 0.0
    for name, g in ref.items():
        denom = float(g.norm())
        other = test.get(name, torch.zeros_like(g))
        worst = max(worst, float((other - g).norm()) / denom if denom > 1e-8 else float(other.norm()))
    return worst


_REFERENCES: dict[str, dict] = {}


def trl_reference(family: str) -> dict:
    """TRL's padded run on :func:`chat_rows`: loss and gradients of one batch of all four (cached per family)."""
    if family not in _REFERENCES:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        model, processor = tiny_vlm(family)
        initial = copy.deepcopy(model.state_dict())
        dataset = Dataset.from_list(chat_rows())
        args = SFTConfig(output_dir="/tmp/pf-trl-vlm-trl", report_to=[], use_cpu=True, assistant_only_loss=True,
                         max_length=None, per_device_train_batch_size=4, save_strategy="no")
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=processor)
        batch = trainer.data_collator([dict(r) for r in dataset])
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        _REFERENCES[family] = {"initial": initial, "processor": processor, "dataset": dataset, "loss": loss.item(),
                               "grads": _grads(model), "model_type": family}
    return _REFERENCES[family]


def pf_trainer(family: str, mode: str, tmp_path, *, dataset=None, **config):
    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

    ref = trl_reference(family)
    model, _ = tiny_vlm(family, ref["processor"])
    model.load_state_dict(ref["initial"])
    args = PaddingFreeConfig(output_dir=str(tmp_path / f"pf-{family}-{mode}"), report_to=[], use_cpu=True,
                             padding_free=mode, max_length=None, max_tokens_per_batch=100_000, save_strategy="no",
                             disable_tqdm=True, **config)
    return PaddingFreeSFTTrainer(model, args=args, train_dataset=dataset if dataset is not None else ref["dataset"],
                                 processing_class=ref["processor"])


def one_batch(trainer) -> dict:
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 1, "the token budget holds the four examples: one packed row"
    return batches[0]


def loss_of(trainer, batch) -> float:
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, dict(batch)))


def per_image_pixels(batch) -> list[torch.Tensor]:
    """The packed pixel_values split per image (Qwen: patches of each grid; Gemma 3: one row per image)."""
    pixels = batch["pixel_values"]
    grid = batch.get("image_grid_thw")
    if grid is None:
        return list(pixels.split(1))
    return list(pixels.split(grid.prod(-1).tolist()))


def image_owners(batch) -> list[int]:
    """The packed example each image of the row belongs to (where its run of image tokens starts)."""
    types = batch.get("mm_token_type_ids", batch.get("token_type_ids"))[0]
    is_image = types == 1
    starts = (is_image & ~torch.cat([torch.tensor([False]), is_image[:-1]])).nonzero().reshape(-1)
    return [int(torch.searchsorted(batch["cu_seq_lens_q"], int(p), right=True)) - 1 for p in starts]


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.slow
@pytest.mark.parametrize(("family", "mode"), CASES)
def test_packed_vlm_equals_trl_padded(family, mode, tmp_path):
    """Loss and gradients of the packed row == TRL's padded batch; each negative control moves the loss."""
    ref = trl_reference(family)
    trainer = pf_trainer(family, mode, tmp_path)
    batch = one_batch(trainer)
    assert batch["input_ids"].shape[0] == 1 and batch["cu_seq_lens_q"].numel() == 5
    n_images = sum(len(r["images"]) for r in chat_rows())
    assert len(per_image_pixels(batch)) == n_images
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    assert abs(float(loss) - ref["loss"]) < LOSS_ATOL, (float(loss), ref["loss"])
    assert grad_error(_grads(trainer.model), ref["grads"]) < GRAD_RTOL
    vision_grads = [n for n in ref["grads"] if "visual" in n or "vision_tower" in n]
    assert vision_grads, "the vision tower trains too (its gradients are compared above)"

    # negative control 1: positions that do not restart per example (one numbering over the whole row): the row is
    # attended as one sequence where the positions decide the layout (Gemma 3, and the mRoPE text row in
    # huggingface mode; pf_varlen keeps examples apart by cu_seq_lens and rotary attention sees only differences)
    total = batch["input_ids"].shape[1]
    if family == "gemma3" or mode == "huggingface":
        bad = dict(batch)
        if family == "gemma3":
            bad["position_ids"] = torch.arange(total)[None]
        else:
            from pf_trl.attention.mrope import rope_index_function

            rope = rope_index_function(trainer.model)
            whole = rope(batch["input_ids"][0], batch["mm_token_type_ids"][0], image_grid_thw=batch["image_grid_thw"])
            bad["position_ids"] = torch.cat([torch.arange(total).reshape(1, 1, -1), whole.unsqueeze(1)], dim=0)
        assert abs(loss_of(trainer, bad) - ref["loss"]) > 1e-3
    if family != "gemma3":
        # negative control 1b: what a text-only packer gives an mRoPE model (per-example 0..n-1 on all three
        # rotary streams): the images lose their height/width layout
        flat = {**batch, "position_ids": batch["position_ids"][:1].expand(4, -1, -1).clone()}
        assert abs(loss_of(trainer, flat) - ref["loss"]) > 1e-4

    # negative control 2: images moved to the wrong example (two images of the same size, in different examples)
    images, owners = per_image_pixels(batch), image_owners(batch)
    i, j = next((i, j) for i in range(len(images)) for j in range(i + 1, len(images))
                if owners[i] != owners[j] and images[i].shape == images[j].shape)
    images[i], images[j] = images[j], images[i]
    moved = {**batch, "pixel_values": torch.cat(images)}
    assert abs(loss_of(trainer, moved) - ref["loss"]) > 1e-4


@pytest.mark.slow
def test_gemma3_needs_pf_trl_image_masks(tmp_path, monkeypatch):
    """Negative control of the Gemma 3 mask: transformers' own packed mask (image blocks read at restarted positions
    in its sliding mask) is not exact; pf-trl's masks are."""
    from pf_trl.attention import multimodal

    ref = trl_reference("gemma3")
    trainer = pf_trainer("gemma3", "huggingface", tmp_path)
    batch = one_batch(trainer)
    assert abs(loss_of(trainer, batch) - ref["loss"]) < LOSS_ATOL
    monkeypatch.setattr(multimodal, "gemma3_packed_masks", lambda model, types, kwargs: None)
    assert abs(loss_of(trainer, batch) - ref["loss"]) > 1e-4


@pytest.mark.slow
def test_padded_mode_is_trls_vision_path(tmp_path, caplog):
    """padding_free=False through PaddingFreeSFTTrainer: the image rows go to TRL's own vision collator, and loss and
    gradients are TRL's. Negative control: left unset, assistant_only_loss trains every token there (TRL's default),
    which moves the loss, and a warning says so."""
    ref = trl_reference("qwen2_vl")
    trainer = pf_trainer("qwen2_vl", False, tmp_path, per_device_train_batch_size=4, assistant_only_loss=True)
    batch = trainer.data_collator([dict(r) for r in trainer.train_dataset])
    assert batch["input_ids"].shape[0] == 4 and "cu_seq_lens_q" not in batch, "padded: one row per example"
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    assert abs(float(loss) - ref["loss"]) < LOSS_ATOL, (float(loss), ref["loss"])
    assert grad_error(_grads(trainer.model), ref["grads"]) < GRAD_RTOL

    with caplog.at_level("WARNING", logger="pf_trl"):
        unset = pf_trainer("qwen2_vl", False, tmp_path / "unset", per_device_train_batch_size=4)
    assert "unset assistant_only_loss trains every token" in caplog.text
    every_token = unset.data_collator([dict(r) for r in unset.train_dataset])
    assert abs(loss_of(unset, every_token) - ref["loss"]) > 1e-3


@pytest.mark.slow
def test_gemma3_images_refused_in_internal_mode(tmp_path):
    from pf_trl.attention.errors import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError, match="padding_free='huggingface' is exact"):
        pf_trainer("gemma3", "internal", tmp_path)


@pytest.mark.slow
def test_prompt_completion_with_images_equals_trl(tmp_path):
    """TRL's conversational prompt/completion with images: loss on the completion only, as TRL's padded run."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    imgs = random_images(3, seed=4)
    rows = [
        {"prompt": [{"role": "user", "content": "Describe."}],
         "completion": [{"role": "assistant", "content": "Noise."}],
         "images": [imgs[0]]},
        {"prompt": [{"role": "user", "content": "And these two?"}],
         "completion": [{"role": "assistant", "content": "More noise, twice."}], "images": [imgs[1], imgs[2]]},
    ]
    model, processor = tiny_vlm("qwen2_5_vl")
    initial = copy.deepcopy(model.state_dict())
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None,
                     per_device_train_batch_size=2, save_strategy="no")
    trl = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=processor)
    ref = trl.compute_loss(model, trl.data_collator(copy.deepcopy(rows)))
    ref.backward()
    ref_grads = _grads(model)

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

    pf_model, _ = tiny_vlm("qwen2_5_vl", processor)
    pf_model.load_state_dict(initial)
    pf = PaddingFreeSFTTrainer(pf_model, processing_class=processor, train_dataset=Dataset.from_list(rows),
                               args=PaddingFreeConfig(output_dir=str(tmp_path / "pf"), report_to=[], use_cpu=True,
                                                      max_length=None, max_tokens_per_batch=10_000))
    batch = one_batch(pf)
    loss = pf.compute_loss(pf.model, dict(batch))
    loss.backward()
    assert abs(float(loss) - float(ref)) < LOSS_ATOL
    assert grad_error(_grads(pf.model), ref_grads) < GRAD_RTOL
    # the prompt (and its image tokens) carries no label
    assert not bool((batch["labels"][batch["mm_token_type_ids"] == 1] != -100).any())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["huggingface", "internal"])
def test_text_only_data_on_gemma3_multimodal_checkpoint(mode, tmp_path):
    """Text-only fine-tuning of Gemma3ForConditionalGeneration (no images, its tokenizer or its processor): exact
    against TRL's padded run, without extracting the text model."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

    rows = [{"messages": [{"role": "user", "content": f"Question {i} " * (i + 1)},
                          {"role": "assistant", "content": f"Answer {i}. " * (2 * i + 1)}]} for i in range(4)]
    model, processor = tiny_vlm("gemma3")
    initial = copy.deepcopy(model.state_dict())
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None,
                     assistant_only_loss=True, per_device_train_batch_size=4, save_strategy="no")
    trl = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=processor.tokenizer)
    trl_batch = trl.data_collator([trl.train_dataset[i] for i in range(4)])
    ref = trl.compute_loss(model, trl_batch)
    ref.backward()
    ref_grads = _grads(model)
    for processing_class in [processor if mode == "huggingface" else processor.tokenizer]:  # both kinds, once each
        pf_model, _ = tiny_vlm("gemma3", processor)
        pf_model.load_state_dict(initial)
        pf = PaddingFreeSFTTrainer(pf_model, processing_class=processing_class, train_dataset=Dataset.from_list(rows),
                                   args=PaddingFreeConfig(output_dir=str(tmp_path / "pf"), report_to=[], use_cpu=True,
                                                          padding_free=mode, max_length=None,
                                                          max_tokens_per_batch=10_000))
        batch = one_batch(pf)
        assert "pixel_values" not in batch
        loss = pf.compute_loss(pf.model, dict(batch))
        loss.backward()
        assert abs(float(loss) - float(ref)) < LOSS_ATOL
        assert grad_error(_grads(pf.model), ref_grads) < GRAD_RTOL


# ------------------------------------------------------------------------------------------ data path


def test_processor_passes_the_vocabulary_check():
    """``len(processor)`` is a TypeError: the vocabulary check reads the processor's tokenizer."""
    from pf_trl.data.tokenizer import TokenizerLoadError, check_vocab_fits

    processor = tiny_processor("qwen2_vl")
    with pytest.raises(TypeError):
        len(processor)
    check_vocab_fits(processor, len(processor.tokenizer))
    with pytest.raises(TokenizerLoadError, match="embeddings"):
        check_vocab_fits(processor, len(processor.tokenizer) - 1)


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_pretokenize_stores_images_and_lengths_with_image_tokens(family, tmp_path):
    """Shards hold TRL's token ids and labels, the images' bytes and the length including the image tokens."""
    from datasets import Dataset
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint
    from pf_trl.data.vision import VisionFeatures

    processor = tiny_processor(family)
    rows = chat_rows()
    manifest = pretokenize(Dataset.from_list(rows), tmp_path / "shards", tokenizer=processor, progress=False)
    shards = load_shards(tmp_path / "shards", expected_tokenizer=tokenizer_fingerprint(processor))
    trl = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)
    key = "token_type_ids" if family == "gemma3" else "mm_token_type_ids"
    assert manifest["source"]["input_format"] == "vision"
    assert manifest["vision"]["images"] == 6 and manifest["vision"]["token_type_key"] == key
    for i, row in enumerate(rows):
        want = trl([copy.deepcopy(row)])
        got = shards[i]
        assert got["input_ids"] == want["input_ids"][0].tolist()
        assert got["labels"] == want["labels"][0].tolist()
        assert got["length"] == want["input_ids"].shape[1]  # image tokens counted: the budget sees them
        assert len(got["images"]) == len(row["images"])
        features = VisionFeatures(processor)(got)
        if row["images"]:
            assert torch.equal(features["pixel_values"], want["pixel_values"])
    image_tokens = sum(int((torch.as_tensor(shards[i][key]) == 1).sum()) for i in range(len(rows)))
    assert manifest["counts"]["tokens"] == sum(shards["length"]) and image_tokens > 0


def test_image_files_are_read_inside_the_data_root_only(tmp_path):
    from pf_trl.data.pretokenize import PretokenizeError, pretokenize

    processor = tiny_processor("qwen2_vl")
    root, outside = tmp_path / "data", tmp_path / "outside"
    (root / "img").mkdir(parents=True)
    outside.mkdir()
    image = random_images(1)[0]
    image.save(root / "img" / "a.png")
    image.save(outside / "b.png")
    row = {"messages": [{"role": "user", "content": "What?"}, {"role": "assistant", "content": "That."}]}

    def write(name, images):
        path = root / name
        path.write_text(json.dumps({**row, "images": images}) + "\n", encoding="utf-8")
        return path

    manifest = pretokenize(write("ok.jsonl", ["img/a.png"]), tmp_path / "ok", tokenizer=processor, progress=False)
    assert manifest["vision"]["image_bytes"] == (root / "img" / "a.png").stat().st_size
    for name, images, match in [
        ("up.jsonl", ["../outside/b.png"], "outside the data roots"),
        ("abs.jsonl", [str(outside / "b.png")], "outside the data roots"),
        ("missing.jsonl", ["img/none.png"], "not found"),
    ]:
        with pytest.raises(PretokenizeError, match=match):
            pretokenize(write(name, images), tmp_path / name, tokenizer=processor, progress=False)
        assert not (tmp_path / name).exists()
    (root / "img" / "big.png").write_bytes(b"\0" * 64)
    from pf_trl.data.vision import ImagePolicy, VisionDataError, image_bytes

    with pytest.raises(VisionDataError, match="limit"):
        image_bytes("img/big.png", 0, ImagePolicy(roots=(str(root),), max_bytes=32))
    with pytest.raises(VisionDataError, match="cannot be decoded"):
        from pf_trl.data.vision import decode_image

        decode_image(b"not an image", 0)


def test_vision_rows_need_a_processor_and_are_never_cut_through_an_image(tmp_path):
    from datasets import Dataset

    from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize
    from pf_trl.data.tokenizer import load_tokenizer

    rows = chat_rows()
    with pytest.raises(PretokenizeError, match="processor"):
        pretokenize(Dataset.from_list(rows), tmp_path / "tok", tokenizer=load_tokenizer(), progress=False)
    processor = tiny_processor("qwen2_vl")
    full = pretokenize(Dataset.from_list(rows), tmp_path / "full", tokenizer=processor, progress=False)
    # a limit that keeps row 1 (no image) and cuts the others' text only after their images or through them
    limit = 30
    cut = pretokenize(Dataset.from_list(rows), tmp_path / "cut", tokenizer=processor, progress=False,
                      config=PretokenizeConfig(max_seq_len=limit))
    from pf_trl.data.shards import load_shards

    kept = load_shards(tmp_path / "cut")
    for row in kept:
        assert row["length"] <= limit
        n_image_tokens = sum(1 for t in row["mm_token_type_ids"] if t)
        assert len(row["images"]) == 0 or n_image_tokens > 0
    assert cut["counts"]["examples"] + cut["counts"]["dropped"] == full["counts"]["examples"]
    assert cut["counts"]["dropped_too_long"] >= 1


def test_collator_packs_images_in_example_order_with_per_example_mrope():
    """PaddingFreeCollator: pixel tensors concatenated in example order, rotary positions from each example alone."""
    from pf_trl.attention.mrope import RopeIndex, rope_index_function
    from pf_trl.batching.collator import PaddingFreeCollator

    model, processor = tiny_vlm("qwen2_vl")
    rope = rope_index_function(model)
    assert isinstance(rope, RopeIndex)
    import pickle

    rope = pickle.loads(pickle.dumps(rope))  # DataLoader workers: no weights travel
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    trl = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)
    singles = [trl([copy.deepcopy(r)]) for r in chat_rows()]
    features = [{k: v[0] if k in ("input_ids", "labels", "mm_token_type_ids") else v for k, v in s.items()
                 if k != "attention_mask"} for s in singles]
    batch = PaddingFreeCollator(rope_index=rope, pad_to_multiple_of=64)(features)
    total = batch["input_ids"].shape[1]
    assert batch["position_ids"].shape == (4, 1, total) and total % 64 == 0
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in singles if "pixel_values" in s]))
    grids = [s["image_grid_thw"] for s in singles if "image_grid_thw" in s]
    assert torch.equal(batch["image_grid_thw"], torch.cat(grids))
    at = 0
    for s in singles:
        n = s["input_ids"].shape[1]
        own, _ = model.model.get_rope_index(s["input_ids"], s["mm_token_type_ids"], s.get("image_grid_thw"))
        assert torch.equal(batch["position_ids"][1:, 0, at:at + n], own[:, 0])
        assert torch.equal(batch["position_ids"][0, 0, at:at + n], torch.arange(n))
        at += n
    assert torch.equal(batch["position_ids"][1:, 0, at:], torch.arange(total - at).expand(3, -1))  # the pad segment


def test_unsupported_multimodal_and_video_are_refused():
    from pf_trl.attention import multimodal
    from pf_trl.attention.errors import UnsupportedFeatureError, UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="vision-language families"):
        _refuse_other_multimodal()
    model, _ = tiny_vlm("qwen2_vl")
    with pytest.raises(UnsupportedFeatureError, match="video"):
        multimodal.prepare_packed(model, {"pixel_values_videos": torch.zeros(1)}, "huggingface")
    with pytest.raises(UnsupportedFeatureError, match="text-position row"):
        model._pf_rope_index = object()
        multimodal.prepare_packed(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long),
                                          "position_ids": torch.zeros(3, 1, 4, dtype=torch.long)}, "huggingface")


def _refuse_other_multimodal():
    """A multimodal type outside the four families is refused by name."""
    import transformers

    from pf_trl.attention import enable_padding_free

    config = transformers.LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        image_token_id=100)
    enable_padding_free(transformers.LlavaForConditionalGeneration(config), allow_unverified=True)

