"""Streaming text: DELTA pieces add up to the final text (emoji, CJK, byte-fallback tokens), never a broken
character; stop strings split across tokens stop the request, excluded or included as asked."""
import pytest

from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.testing import make_tiny_checkpoint
from minivllm.transformers_utils.tokenizer import get_tokenizer
from minivllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from minivllm.v1.engine.detokenizer import make_test_tokenizers
from minivllm.v1.engine.output_processor import OutputProcessor

TEXT = "Hi 🙂 你好世界 café ✓ naïve 🎉 done"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def tokenizers(ckpt):
    byte_level, byte_fallback = make_test_tokenizers()
    return {"byte_level": byte_level, "byte_fallback": byte_fallback, "checkpoint": get_tokenizer(ckpt)}


def feed(tok, ids, kind, prompt_ids, **params):
    "Run `ids` through an OutputProcessor one token per step; returns (outputs, reqs_to_abort)."
    op = OutputProcessor(tok)
    req = EngineCoreRequest("r-1", prompt_ids, None, SamplingParams(output_kind=kind, max_tokens=len(ids), **params),
                            None, None, 0.0, external_req_id="r")
    op.add_request(req, None)
    outs, aborts = [], []
    for i, t in enumerate(ids):
        fin = FinishReason.LENGTH if i == len(ids) - 1 else None
        res = op.process_outputs([EngineCoreOutput("r-1", [t], finish_reason=fin)])
        outs += res.request_outputs
        aborts += res.reqs_to_abort
        if not op.has_unfinished_requests(): break
    return outs, aborts


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback", "checkpoint"])
def test_delta_concatenates_to_final_text(ckpt, name):
    tok = tokenizers(ckpt)[name]
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompt = tok.encode("Say:", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert len(ids) > len(TEXT.split()), "multi-token characters expected"
    if name == "byte_fallback": assert any(p.startswith("<0x") for p in pieces)
    deltas, _ = feed(tok, ids, RequestOutputKind.DELTA, prompt)
    cumulative, _ = feed(tok, ids, RequestOutputKind.CUMULATIVE, prompt)
    texts = [o.outputs[0].text for o in deltas]
    assert all("\ufffd" not in t for t in texts), texts
    final = cumulative[-1].outputs[0].text
    assert "".join(texts) == final
    assert final.strip() == TEXT
    # cumulative outputs only ever grow
    for a, b in zip(cumulative, cumulative[1:]): assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert sum((o.outputs[0].token_ids for o in deltas), []) == ids


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stop_string_split_across_tokens(include, kind):
    tok, _ = make_test_tokenizers()
    text = "Stop here. END of text."
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert "ĠEN" in pieces and "D" in pieces, pieces   # " END" arrives as two tokens
    outs, aborts = feed(tok, ids, kind, tok.encode("Hi", add_special_tokens=False), stop=["END"],
                        include_stop_str_in_output=include)
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == "END"
    text_out = "".join(o.outputs[0].text for o in outs) if kind == RequestOutputKind.DELTA else last.outputs[0].text
    assert text_out == ("Stop here. END" if include else "Stop here. ")
    assert aborts == ["r-1"]   # the engine core did not know: the front end aborts it there


def test_engine_stop_string_and_streaming(ckpt):
    llm = LLM(ckpt, dtype="float32", max_model_len=128)
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    # a stop string straddling the boundary between two generated tokens: the end of token k, the start of k+1
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    incs = [pieces[i + 1][len(pieces[i]):] if pieces[i + 1].startswith(pieces[i]) else "" for i in range(len(full.token_ids))]
    k = next(i for i in range(len(incs) - 1)
             if len(incs[i]) >= 2 and incs[i + 1] and (incs[i] + incs[i + 1][:1]).isascii()
             and "\ufffd" not in incs[i] + incs[i + 1])
    stop = incs[k][-2:] + incs[k + 1][:1]
    cut = full.text.find(stop)
    assert cut >= 0
    for include in (False, True):
        out = llm.generate(prompt, SamplingParams(stop=[stop], include_stop_str_in_output=include, **greedy),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == full.text[:cut + (len(stop) if include else 0)], (stop, out.text, full.text)
    assert not llm.llm_engine.has_unfinished_requests()
    # DELTA through the engine: the pieces add up to the CUMULATIVE text
    engine = llm.llm_engine
    engine.add_request("s", prompt, SamplingParams(output_kind=RequestOutputKind.DELTA, **greedy))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].text for o in engine.step()]
    assert "".join(deltas) == full.text and len(deltas) > 1
