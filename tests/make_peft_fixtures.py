"""Build tests/fixtures/peft/{llama,gpt2}/: LoRA adapters saved by PEFT itself for the Hugging
Face fixtures (tests/fixtures/hf/), so that tests/test_lora.py can check that
`megajax-convert export --adapter` writes the files PEFT writes: the same tensor names and
shapes, and a config PEFT reads to the same modules.

Run by hand, in an environment with PEFT (never by the test suite):

    /tmp/hfenv/bin/pip install torch==2.13.0 transformers==5.25.0 peft==0.21.2
    /tmp/hfenv/bin/python tests/make_peft_fixtures.py

Each adapter has rank 4 and alpha 8 on every linear layer of the blocks (Llama: q, k, v, o,
gate, up and down projections; GPT-2: c_attn, attn.c_proj, c_fc and mlp.c_proj), with random
B (PEFT starts it at zero) so that a value mix-up would show.
"""

import json
from pathlib import Path

import peft
import torch
import transformers

HERE = Path(__file__).resolve().parent
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}


def main():
    torch.manual_seed(0)
    for name, targets in TARGETS.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(HERE / "fixtures" / "hf" / name)
        config = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=targets,
            fan_in_fan_out=name == "gpt2",
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(base, config)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        out = HERE / "fixtures" / "peft" / name
        model.save_pretrained(out)
        (out / "README.md").unlink()  # PEFT's model card: nothing the test reads
        config = json.loads((out / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = f"tests/fixtures/hf/{name}"
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(name, sum(p.numel() for n, p in model.named_parameters() if "lora_" in n))


if __name__ == "__main__":
    main()
