"""The multimodal reader (ds_seqpar/cli/vlm): records, labels, packing with per-document mRoPE positions, the
collate, and its refusals; single process, on the shipped tiny Qwen2-VL and assets/vlm_data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from ds_seqpar.cli.vlm import (
    PackedVlmDataset,
    collate_vlm,
    family_of,
    hf_inputs,
    position_function,
    read_vlm_data,
    reference_loss,
    uses_vlm_reader,
)
from ds_seqpar.errors import MissingFileError, SeqParConfigError

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "assets" / "tiny-qwen2-vl")
DATA = ROOT / "assets" / "vlm_data"


@pytest.fixture(scope="module")
def config():
    return AutoConfig.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def records(config):
    return read_vlm_data(str(DATA / "train.jsonl"), MODEL, config, 256)


@pytest.fixture(scope="module")
def model(config):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()


def test_labels_mask_visual_tokens_prompt_and_first_token(config, records):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    lines = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    assert len(records) == len(lines) == 18
    visual = [
        config.image_token_id,
        config.video_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    ]
    for rec, line in zip(records, lines):
        ids, labels = rec.input_ids, rec.labels
        assert labels[0] == -100 and ids[-1] == tok.eos_token_id == labels[-1]
        assert (labels[torch.isin(ids, torch.tensor(visual))] == -100).all()
        # what is labelled is exactly the text (all of it but a first token) and EOS
        text_ids = tok(line["text"], add_special_tokens=False)["input_ids"]
        kept = ids[labels != -100].tolist()
        assert kept == (
            [*text_ids, tok.eos_token_id] if line.get("prompt") else [*text_ids[1:], tok.eos_token_id]
        )
        # one image token per merged patch, typed 1 in mm_token_type_ids
        images = rec.vision.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        n_image = int((ids == config.image_token_id).sum())
        assert n_image == int(images.prod(-1).sum()) // 4 == int((rec.mm_token_type_ids == 1).sum())
        assert len(images) == len(line.get("images", []))


def test_packing_positions_are_each_records_own_rope_index(config, records, model):
    data = PackedVlmDataset(records, 256, position_function(family_of(config), model), pad_token_id=7)
    assert [i for row in data.rows for i in row] == list(range(len(records)))
    for r, row in enumerate(data.rows):
        sample, start = data[r], 0
        for d, i in enumerate(row):
            rec, end = records[i], start + len(records[i])
            grids = {k: v for k, v in rec.vision.items() if k.endswith("grid_thw")}
            own, _ = model.model.get_rope_index(
                rec.input_ids[None], mm_token_type_ids=rec.mm_token_type_ids[None], **grids
            )
            assert torch.equal(sample["position_ids"][:, start:end], own[:, 0])
            assert (sample["doc_ids"][start:end] == d).all()
            assert torch.equal(sample["input_ids"][start:end], rec.input_ids)
            start = end
        assert (sample["doc_ids"][start:] == -1).all() and (sample["labels"][start:] == -100).all()
        assert (sample["input_ids"][start:] == 7).all()


def test_packed_batch_through_hf_equals_each_record_alone(config, records, model):
    """The collated batch (vision inputs concatenated in row order, mRoPE per document) through the plain HF
    forward, with its packed-sequence mask from restarting text positions, gives the records' loss alone."""
    data = PackedVlmDataset(records, 256, position_function(family_of(config), model))
    batch = collate_vlm([data[0], data[1]])
    assert batch["position_ids"].shape == (3, 2, 256) and batch["input_ids"].shape == (2, 256)
    assert torch.equal(
        batch["image_grid_thw"], torch.cat([r.vision["image_grid_thw"] for r in records if r.vision])
    )
    with torch.no_grad():
        packed = model(**hf_inputs(batch)).loss
        alone = reference_loss(model, [records[i] for row in data.rows[:2] for i in row])
    assert abs(packed.item() - alone.item()) <= 1e-5 * abs(alone.item()), (packed.item(), alone.item())


def test_uses_vlm_reader_only_for_a_vlm_and_records_with_vision(config, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "a red square ."}\n')
    assert uses_vlm_reader(config, str(DATA / "train.jsonl"))
    assert not uses_vlm_reader(config, str(text))
    assert not uses_vlm_reader(
        AutoConfig.from_pretrained(ROOT / "assets" / "tiny-llama"), str(DATA / "train.jsonl")
    )


def _write(tmp_path: Path, *records: dict) -> str:
    shutil.copytree(DATA / "img", tmp_path / "img", dirs_exist_ok=True)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


IMG = "img/red_square.png"
REFUSALS = [
    ({"text": "<image> a .", "images": ["img/nope.png"]}, MissingFileError, "'img/nope.png' does not exist"),
    ({"text": "<image> <image> a .", "images": [IMG]}, SeqParConfigError, "2 <image> placeholders"),
    ({"text": "a red square .", "images": [IMG]}, SeqParConfigError, "0 <image> placeholders"),
    ({"text": "<image> a .", "images": [IMG], "audio": ["x.wav"]}, SeqParConfigError, "fields ['audio']"),
    (
        {"text": "<|image_pad|> a .", "images": []},
        SeqParConfigError,
        "the family's own token '<|image_pad|>'",
    ),
    ({"prompt": 3, "text": "a ."}, SeqParConfigError, "field 'prompt' must be a string"),
    ({"text": "<video> a .", "videos": [[]]}, SeqParConfigError, "has no frame"),
    ({"text": "a .", "fps": 2}, SeqParConfigError, "field 'fps' must be a number > 0"),
    (
        {"text": "<video> a .", "videos": [[IMG]], "fps": 0},
        SeqParConfigError,
        "field 'fps' must be a number > 0",
    ),
    (
        {"text": "<image> " + "red " * 300, "images": [IMG]},
        SeqParConfigError,
        "do not fit a row of --seq-len 256",
    ),
]


@pytest.mark.parametrize("record,error,message", REFUSALS)
def test_refusals_name_the_record_and_the_fix(config, tmp_path, record, error, message):
    path = _write(tmp_path, {"text": "a red square ."}, record)
    with pytest.raises(error, match=None) as info:
        read_vlm_data(path, MODEL, config, 256)
    assert message in str(info.value) and f"{path}:2" in str(info.value), str(info.value)


def test_refusals_of_the_file_and_the_family(config, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a ."\n')
    with pytest.raises(SeqParConfigError, match=r"bad.jsonl:1 is not valid JSON"):
        read_vlm_data(str(bad), MODEL, config, 256)
    with pytest.raises(MissingFileError, match="does not exist"):
        read_vlm_data(str(tmp_path / "none.jsonl"), MODEL, config, 256)
    llama = AutoConfig.from_pretrained(ROOT / "assets" / "tiny-llama")
    with pytest.raises(
        SeqParConfigError,
        match=r"model_type 'llama' has no multimodal data rule \(supported: qwen2_5_vl, qwen2_vl\)",
    ):
        read_vlm_data(str(DATA / "train.jsonl"), MODEL, llama, 256)


def test_videos_are_read_without_torchvision(config):
    """Videos go through the image processor (tests/test_vlm_video.py checks the layout), torchvision or not."""
    records = read_vlm_data(str(DATA / "videos.jsonl"), MODEL, config, 256)
    assert all(r.vision["video_grid_thw"].tolist() == [[2, 4, 4]] for r in records)


TRAIN = ["--data", str(DATA / "train.jsonl"), "--seq-len", "256", "--max-steps", "2"]
VLM = ["--model", MODEL, "--random-init"]
PARSE_REFUSALS = [
    ([*TRAIN], "has no vision_config: the text reader would drop the images"),
    ([*VLM, *TRAIN, "--packing", "balanced"], "--packing 'balanced' with multimodal --data"),
    ([*VLM, *TRAIN, "--text-field", "caption"], "--text-field 'caption' with multimodal --data"),
    ([*VLM, *TRAIN, "--seq-len", "32"], "do not fit a row of --seq-len 32"),
    ([*VLM, *TRAIN, "--objective", "mlm"], "--objective 'mlm' with multimodal --data"),
]


@pytest.mark.parametrize("argv,message", PARSE_REFUSALS)
def test_train_py_refuses_in_parse_args(argv, message):
    """train.py --data with images: what the multimodal reader cannot honour fails in parse_args (no process
    group exists yet), the text reader never sees such records."""
    from ds_seqpar.cli import parse_args

    with pytest.raises(SeqParConfigError) as info:
        parse_args(argv)
    assert message in str(info.value), str(info.value)


def test_refusals_of_unreadable_images_and_unpacked_processor_outputs(config, tmp_path):
    from ds_seqpar.cli.vlm import FAMILIES, VlmEncoder, VlmRecord, load_processor

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "bad.png").write_text("not a png")
    path = _write(tmp_path, {"text": "<image> a .", "images": ["img/bad.png"]})
    with pytest.raises(
        SeqParConfigError, match=r"data.jsonl:1: field 'images': 'img/bad.png' is not an image"
    ):
        read_vlm_data(path, MODEL, config, 256)
    processor, _ = load_processor(MODEL)

    class Extra:  # the processor's outputs and one the reader does not know how to pack
        tokenizer = processor.tokenizer

        def __call__(self, **kwargs):
            return {**processor(**kwargs), "second_per_grid_ts": torch.ones(1)}

    encoder = VlmEncoder(Extra(), FAMILIES["qwen2_vl"], config)
    with pytest.raises(
        SeqParConfigError, match=r"x.jsonl:3: the processor returned \['second_per_grid_ts'\]"
    ):
        encoder.encode(VlmRecord("x.jsonl:3", "", "a red square .", (), ()))

    class Merging:  # a tokenizer that merges the prompt's last token with the text's first
        tokenizer = processor.tokenizer

        def __call__(self, text, **kwargs):
            out = processor(text=text, **kwargs)
            if text[0].endswith("square ."):
                out["input_ids"] = out["input_ids"].clone()
                out["input_ids"][0, 1] = 5
            return out

    encoder = VlmEncoder(Merging(), FAMILIES["qwen2_vl"], config)
    with pytest.raises(
        SeqParConfigError, match=r"x.jsonl:4: the tokens of the prompt alone are not the first"
    ):
        encoder.encode(VlmRecord("x.jsonl:4", "what is ", "a red square .", (), ()))


def _tiny_qwen2_5_vl(folder: Path) -> str:
    """The shipped tiny Qwen2-VL's tokenizer and image processor with a Qwen2.5-VL config and processor class."""
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    ):
        shutil.copy(Path(MODEL) / name, folder / name)
    config = json.loads((Path(MODEL) / "config.json").read_text())
    config.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"])
    config["text_config"]["model_type"] = "qwen2_5_vl_text"
    config["vision_config"] = {
        "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
        "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1], "patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return str(folder)


def test_qwen2_5_vl_images_pack_like_each_record_alone_and_videos_are_refused(tmp_path):
    """A second family through the same reader (one FAMILIES entry): its own processor class and rope index;
    the packed rows through the plain HF forward give each record's own loss; its videos are refused by name."""
    path = _tiny_qwen2_5_vl(tmp_path)
    config = AutoConfig.from_pretrained(path)
    records = read_vlm_data(str(DATA / "train.jsonl"), path, config, 256)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    data = PackedVlmDataset(records, 256, position_function(family_of(config), model))
    row, start = data[0], 0
    for i in data.rows[0]:
        rec = records[i]
        grids = {k: v for k, v in rec.vision.items() if k.endswith("grid_thw")}
        own, _ = model.model.get_rope_index(
            rec.input_ids[None], mm_token_type_ids=rec.mm_token_type_ids[None], **grids
        )
        assert torch.equal(row["position_ids"][:, start : start + len(rec)], own[:, 0])
        start += len(rec)
    with torch.no_grad():
        packed = model(**hf_inputs(collate_vlm([data[0], data[1]]))).loss
        alone = reference_loss(model, records)
    assert abs(packed.item() - alone.item()) <= 1e-5 * abs(alone.item()), (packed.item(), alone.item())
    with pytest.raises(SeqParConfigError, match=r"videos.jsonl:1: a record with videos and no 'fps'"):
        read_vlm_data(str(DATA / "videos.jsonl"), path, config, 256)


def test_qwen2_5_vl_videos_with_fps_space_temporal_patches_and_pack_like_each_record_alone(tmp_path):
    """Qwen2.5-VL videos: the record's fps gives second_per_grid_ts = 2 / fps; the video tokens' temporal
    positions step by tokens_per_second * 2 / fps; packed rows of mixed.jsonl (fps 2 on every line) give each
    record's own rope index and loss."""
    path = _tiny_qwen2_5_vl(tmp_path)
    config = AutoConfig.from_pretrained(path)
    lines = [json.loads(x) for x in (DATA / "mixed.jsonl").read_text().splitlines()]
    for x in lines:  # absolute paths: the file is written elsewhere
        x["images"] = [str(DATA / f) for f in x.get("images", [])]
        x["videos"] = [[str(DATA / f) for f in v] for v in x.get("videos", [])]
        x.update({"fps": 2} if x["videos"] else {})
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = read_vlm_data(str(tmp_path / "mixed.jsonl"), path, config, 128)
    rec = records[1]
    assert rec.vision["second_per_grid_ts"].tolist() == [1.0]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    keys = ("video_grid_thw", "second_per_grid_ts")
    pos, _ = model.model.get_rope_index(
        rec.input_ids[None], mm_token_type_ids=rec.mm_token_type_ids[None], **{k: rec.vision[k] for k in keys}
    )
    step = int(config.vision_config.tokens_per_second)  # * 2 / fps = 1 second a temporal patch
    assert pos[0, 0, 1:9].tolist() == [1] * 4 + [1 + step] * 4
    data = PackedVlmDataset(records, 128, position_function(family_of(config), model))
    for r, row in enumerate(data.rows):
        start = 0
        for i in row:
            grids = {k: v for k, v in records[i].vision.items() if k.endswith("grid_thw") or k == keys[1]}
            own, _ = model.model.get_rope_index(
                records[i].input_ids[None], mm_token_type_ids=records[i].mm_token_type_ids[None], **grids
            )
            assert torch.equal(data[r]["position_ids"][:, start : start + len(records[i])], own[:, 0])
            start += len(records[i])
    with torch.no_grad():
        packed = model(**hf_inputs(collate_vlm([data[i] for i in range(len(data))]))).loss
        alone = reference_loss(model, records)
    assert abs(packed.item() - alone.item()) <= 1e-5 * abs(alone.item()), (packed.item(), alone.item())
