"""What the offline tiny-checkpoint builders share, and the CLIP text tower CDPruner reads.

Tests, the benchmarks and the bundled demo model need real Hugging Face checkpoints
without network access. Each family's ``build_tiny`` (in its adapter module) creates a
randomly initialised model from the real classes, with a word-level tokenizer built here
(``tokenizers``), the family's PIL image processor and processor, and ``save_pretrained``
of all of it so that ``from_pretrained(path)`` round-trips.

transformers-5 details followed here (see the demo-model spec, "Pitfalls"): the
PIL image processors are used directly (no torchvision), ``LlavaProcessor`` gets
``num_additional_image_tokens=1`` so the ``"default"`` strategy yields rows*cols
image tokens, and a ``TemplateProcessing`` post-processor prepends ``<s>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<image>")
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# words the chat templates below emit; added to every vocabulary so prompts never hit <unk>
LLAVA_TEMPLATE_WORDS = ("USER", "ASSISTANT", ":", "?", ".", ",", "yes", "no", "Yes", "No")
QWEN_TEMPLATE_WORDS = ("system", "user", "assistant", "You", "are", "a", "helpful", ".", "?", ",",
                       "yes", "no", "Yes", "No")

# the llava-hf chat template: "USER: <image>\n{text} ASSISTANT:" (system text, if any, first)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# the Qwen2.5-VL chat template for image + text messages (default system prompt as in Qwen2.5-VL)
QWEN_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _vocabulary(words: Sequence[str], special: Sequence[str], template_words: Sequence[str]) -> list[str]:
    """Special tokens first, then the given words and template words, without repeats."""
    vocabulary: list[str] = []
    for word in (*special, *words, *template_words):
        if word not in vocabulary:
            vocabulary.append(word)
    return vocabulary


def word_level_tokenizer(
    words: Sequence[str],
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    bos_token: str | None = "<s>",
    eos_token: str = "</s>",
    pad_token: str = "<pad>",
    unk_token: str = "<unk>",
    extra_attributes: dict[str, str] | None = None,
):
    """A ``PreTrainedTokenizerFast`` over ``special_tokens + words`` (ids in that order).

    WordLevel model, Whitespace pre-tokenizer (``\\w+|[^\\w\\s]+``), and a
    ``TemplateProcessing`` post-processor that prepends ``bos_token`` (omitted when
    ``bos_token`` is None). The special tokens are registered as added tokens so that
    ``<image>`` survives pre-tokenisation, and the result reloads with
    ``AutoTokenizer.from_pretrained`` after ``save_pretrained``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = _vocabulary(words, special_tokens, ())
    if unk_token not in vocabulary:
        raise ValueError(f"the unknown token {unk_token!r} must be one of the special tokens")
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary)}, unk_token=unk_token))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos_token is not None:
        bos_id = vocabulary.index(bos_token)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A $B", special_tokens=[(bos_token, bos_id)]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        unk_token=unk_token,
        **(extra_attributes or {}),
    )
    named = (bos_token, eos_token, pad_token, unk_token)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in special_tokens if t not in named]})
    return tokenizer


def qwen_tokenizer(words: Sequence[str], extra_special_tokens: Sequence[str] = ()):
    """A word-level tokenizer with the Qwen-VL special tokens and ``extra_special_tokens``
    (no BOS, ``<|im_end|>`` ends a turn) and the Qwen chat template."""
    special = (*SPECIAL_TOKENS, *QWEN_SPECIAL_TOKENS, *extra_special_tokens)
    tokenizer = word_level_tokenizer(
        _vocabulary(words, special, QWEN_TEMPLATE_WORDS),
        special_tokens=special,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def build_clip(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    vision_hidden_size: int = 64,
    image_size: int = 112,
    patch_size: int = 14,
    text_hidden_size: int = 32,
    text_layers: int = 1,
    text_heads: int = 2,
    context_length: int = 16,
    projection_dim: int = 16,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``CLIPModel`` (text tower + projections) with a tokenizer.

    A stand-in for the CLIP checkpoint CDPruner reads its text relevance from; its
    vision width must equal the LLaVA vision tower's (``vision_hidden_size``).
    """
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    save_dir = Path(save_dir)
    tokenizer = word_level_tokenizer(_vocabulary(words, SPECIAL_TOKENS, ()))
    text = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_hidden_size,
        intermediate_size=2 * text_hidden_size,
        num_hidden_layers=text_layers,
        num_attention_heads=text_heads,
        max_position_embeddings=context_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)).eval()
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir


__all__ = [
    "word_level_tokenizer",
    "build_clip",
    "qwen_tokenizer",
    "SPECIAL_TOKENS",
    "QWEN_SPECIAL_TOKENS",
]
