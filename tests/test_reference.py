"""The NumPy reference forward against the float32 golden figures of an independent implementation."""

from __future__ import annotations

import numpy as np
import pytest

from barellm.arch.config import config_from_metadata
from barellm.arch.llama import ReferenceEngine
from barellm.errors import InvalidRequest
from barellm.formats.gguf import GGUFFile

from conftest import load_data

pytestmark = pytest.mark.model

SMOLLM = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def engine(smollm_gguf):
    src = GGUFFile(smollm_gguf)
    cfg = config_from_metadata(src.metadata, src.tensors["token_embd.weight"].shape[0],
                               tied_output="output.weight" not in src.tensors)
    return ReferenceEngine(cfg, src, n_ctx=128)


def golden(model: str):
    return load_data("golden_logits.json")["models"][model]["results"]


@pytest.mark.parametrize("case", golden(SMOLLM), ids=lambda c: c["label"])
def test_logits_match_golden_at_every_position(engine, case):
    ids = case["prompt_ids"] + case["greedy_ids"]
    logits = engine.forward(ids, 0, all_logits=True)
    assert logits.shape == (len(ids), engine.n_vocab)
    top = np.array(case["top10_ids"])
    got = np.take_along_axis(logits, top, axis=1)
    np.testing.assert_allclose(got, np.array(case["top10_logits"]), atol=2e-3, rtol=0)
    # the full rows agree too, through their log-sum-exp
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    np.testing.assert_allclose(lse, np.array(case["logsumexp"]), atol=2e-3, rtol=0)


@pytest.mark.parametrize("case", golden(SMOLLM), ids=lambda c: c["label"])
def test_greedy_continuation_matches_golden(engine, case):
    prompt = case["prompt_ids"]
    logits = engine.forward(prompt, 0)[-1]
    out = []
    for i in range(32):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = engine.forward([tok], len(prompt) + i)[-1]
    assert out == case["greedy_ids"]


def test_prefill_in_chunks_equals_one_pass(engine):
    ids = golden(SMOLLM)[2]["prompt_ids"] + golden(SMOLLM)[2]["greedy_ids"]
    whole = engine.forward(ids, 0, all_logits=True)
    parts = [engine.forward(ids[i:i + 7], i, all_logits=True) for i in range(0, len(ids), 7)]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-4, rtol=0)


def test_bad_positions_and_ids_are_refused(engine):
    with pytest.raises(InvalidRequest):
        engine.forward([1, 2], engine.n_ctx - 1)
    with pytest.raises(InvalidRequest):
        engine.forward([engine.n_vocab], 0)
    with pytest.raises(InvalidRequest):
        engine.forward([], 0)
