"""A tiny Qwen-architecture model the project builds itself, for tests and benchmarks.

No model hub is reachable where nextstate is tested, so the fast suite needs a model it can
make from nothing in well under a second: random weights, a byte-level BPE tokenizer trained on
a built-in corpus, and a ChatML chat template that renders tools the way Qwen2.5 does. Its text
is gibberish; what it proves is that every code path (templating, KV-cache decoding, logprobs,
LoRA) works on a real transformers architecture.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Passes over each batch for servers on this model: its updates never reach the KL target that
# stops the default's four early, and four doubled the suite's time (tests/test_learner.py checks
# the passes themselves).
TINY_PPO_EPOCHS = 1

# How far what the local engine serves may be from the learner's float32 numbers: llama.cpp,
# its default runtime on a CPU, serves a float16 copy of the model (7.7e-4 at most measured on
# the tiny models; tests/test_llama_cpp_engine.py).
SERVED_TOLERANCE = 2e-3

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen marks these as added but not special, so they survive skip_special_tokens decoding and
# the proxy can see tool calls in the generated text.
TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    # HF renders templates with trim_blocks, which eats the newline right after a block tag,
    # so newlines that follow one are written as {{ '\n' }}.
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}"
    "{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "{{ '}\n' }}</tool_call>"
    "{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role + '\n' + message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. You are a helpful assistant.
Hello! How can I help you today? Thanks, that works. No, I meant the other file.
Please write a short poem about the sea. Sure, here is a poem about the sea.
What is the weather in Paris? Let me call the weather tool for you.
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
The tool returned an error: file not found. I will try again with the right path.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation . , ; : ! ? ( ) [ ] { } < > / \\ | - _ = + * & ^ % $ # @ ~ `
Summarise the conversation above in one sentence. Change X to Y. Great, thank you!
def add(a, b): return a + b  # code is text too
"""


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, hidden_size: int = 64, layers: int = 2, init_std: float = 0.02
) -> Path:
    """Write a complete HF model directory (config, weights, tokenizer, template) to `out_dir`.

    With the default init the next-token distribution is nearly uniform; a larger `init_std`
    (0.4) makes it peaked like a trained model's, which learning tests need to see a signal.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
