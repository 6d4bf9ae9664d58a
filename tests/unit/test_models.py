"""The project's model definitions: torchvision-exact structure, registry, torch-free sizes."""

from __future__ import annotations

import pytest
import torch

from commd import models
from commd.models.bert import Bert, BertConfig
from commd.models.sizes import resnet50_layer_sizes

# (tensors, parameters): ResNet-50 and VGG-16 as torchvision; bert_base = HF BertModel + head.
EXPECTED = {
    "resnet50": (161, 25_557_032),
    "vgg16": (32, 138_357_544),
    "bert_base": (201, 109_483_778),
    "small_cnn": (12, 591_274),
}


def on_meta(name: str) -> torch.nn.Module:
    # The meta device allocates nothing: structure checks of 138 M parameters in milliseconds.
    with torch.device("meta"):
        return models.MODELS[name]()


def test_registry_names_match_the_torch_free_list() -> None:
    assert tuple(models.MODELS) == models.MODEL_NAMES == tuple(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parameter_counts(name: str) -> None:
    params = list(on_meta(name).parameters())
    assert (len(params), sum(p.numel() for p in params)) == EXPECTED[name]
    assert all(p.requires_grad and p.dtype == torch.float32 for p in params)


def test_resnet50_structure_is_torchvisions() -> None:
    named = dict(on_meta("resnet50").named_parameters())
    convs = [n for n, p in named.items() if p.dim() == 4]
    assert len(convs) == 53  # 1 stem + 16 blocks x 3 + 4 projection shortcuts
    assert not any(n.replace("weight", "bias") in named for n in convs)  # convs have no bias
    assert sum(".downsample.0." in n for n in named) == 4
    assert sum(n.endswith("conv1.weight") and n.startswith("layer") for n in named) == 16
    assert [len(getattr(on_meta("resnet50"), f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert named["fc.weight"].shape == (1000, 2048) and "fc.bias" in named
    assert list(named)[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]


def test_vgg16_layout_is_torchvisions() -> None:
    named = dict(on_meta("vgg16").named_parameters())
    assert list(named)[:2] == ["features.0.weight", "features.0.bias"]
    assert named["classifier.0.weight"].shape == (4096, 25088)
    assert list(named)[-2:] == ["classifier.6.weight", "classifier.6.bias"]


def test_sizes_agree_with_the_torch_resnet50() -> None:
    from_torch = [(n, p.numel()) for n, p in on_meta("resnet50").named_parameters()]
    assert resnet50_layer_sizes() == from_torch


@pytest.mark.parametrize(("name", "batch"), [("small_cnn", 4), ("resnet50", 2)])
def test_training_convention_images(name: str, batch: int) -> None:
    torch.manual_seed(0)
    model = models.build(name)
    logits = model(*models.example_input(name, batch))
    assert logits.shape == (batch, models.num_classes(name))
    models.loss(logits, models.example_target(name, batch)).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_training_convention_bert() -> None:
    inputs = models.example_input("bert_base", 2, seq_len=16)
    assert [t.shape for t in inputs] == [(2, 16), (2, 16)] and inputs[0].dtype == torch.int64
    torch.manual_seed(0)
    model = Bert(BertConfig(hidden=64, heads=4, ffn=128, layers=2))  # same code, small shapes
    logits = model(*inputs)
    assert logits.shape == (2, 2)
    models.loss(logits, models.example_target("bert_base", 2)).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bert_attention_mask_hides_padding() -> None:
    torch.manual_seed(0)
    model = Bert(BertConfig(hidden=64, heads=4, ffn=128, layers=2)).eval()
    ids = torch.randint(0, 1000, (1, 10))
    mask = torch.ones(1, 10, dtype=torch.int64)
    mask[:, 6:] = 0
    other = ids.clone()
    other[:, 6:] = 7  # change only the padded positions
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask), model(other, attention_mask=mask)
    torch.testing.assert_close(a, b)


def test_bert_has_separate_qkv_tensors() -> None:
    names = [n for n, _ in on_meta("bert_base").named_parameters()]
    for proj in ("query", "key", "value", "out"):
        assert f"layers.0.attn.{proj}.weight" in names
    assert names[0] == "word_embeddings.weight" and names[-1] == "classifier.bias"


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="valid models: resnet50, vgg16, bert_base, small_cnn"):
        models.example_input("alexnet", 1)
    with pytest.raises(AttributeError):
        _ = models.not_a_thing  # type: ignore[attr-defined]
