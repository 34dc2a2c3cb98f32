"""Offline builders for small LLaVA and Qwen2.5-VL checkpoints from configs.

Tests, the benchmarks and the bundled demo model need real Hugging Face checkpoints
without network access; they build them through each adapter's ``build_tiny``, which for
these two families calls the builders here (the other families keep theirs in their own
module, with the shared tokenizers from here). These builders create randomly initialised
models from the real classes, a word-level tokenizer built with ``tokenizers``, the
family's PIL image processor and processor, and ``save_pretrained`` all of it so that
``from_pretrained(path)`` round-trips.

transformers-5 details followed here (see the demo-model spec, "Pitfalls"): the
PIL image processors are used directly (no torchvision), ``LlavaProcessor`` gets
``num_additional_image_tokens=1`` so the ``"default"`` strategy yields rows*cols
image tokens, and a ``TemplateProcessing`` post-processor prepends ``<s>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from prune_audit.models.tiny_qwen import qwen_text_config, qwen_vision_token_ids, save_tiny_qwen

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
QWEN_TEMPLATE_WORDS = (
    "system",
    "user",
    "assistant",
    "You",
    "are",
    "a",
    "helpful",
    ".",
    "?",
    ",",
    "yes",
    "no",
    "Yes",
    "No",
)

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


WORD_PATTERN = r"\d+\.\d+|\w+|[^\w\s]+"
"""How the word-level tokenizers split text: decimal numbers whole (a box's ``0.07``), then the ``Whitespace``
pre-tokenizer's words and punctuation runs (text without decimals splits exactly as ``Whitespace`` splits it)."""


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

    WordLevel model, a pre-tokenizer keeping the matches of ``WORD_PATTERN``, and a
    ``TemplateProcessing`` post-processor that prepends ``bos_token`` (omitted when
    ``bos_token`` is None). The special tokens are registered as added tokens so that
    ``<image>`` survives pre-tokenisation, and the result reloads with
    ``AutoTokenizer.from_pretrained`` after ``save_pretrained``.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocabulary = _vocabulary(words, special_tokens, ())
    if unk_token not in vocabulary:
        raise ValueError(f"the unknown token {unk_token!r} must be one of the special tokens")
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary)}, unk_token=unk_token))
    # a decoded box reads "[ 0.07 , ... ]" (words joined by spaces), which the box parsers read; "0 . 07" they would not
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="removed", invert=True)
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


def build_llava(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    image_size: int = 112,
    patch_size: int = 14,
    vision_hidden_size: int = 64,
    vision_intermediate_size: int = 128,
    vision_layers: int = 2,
    vision_heads: int = 4,
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int | None = None,
    vision_feature_layer: int = -2,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``LlavaForConditionalGeneration`` with its processor.

    CLIP vision tower (``quick_gelu``) + 2-layer GELU projector + Llama decoder,
    ``vision_feature_select_strategy="default"`` (CLS dropped), so the prompt carries
    ``(image_size // patch_size) ** 2`` ``<image>`` tokens. The vocabulary is
    ``SPECIAL_TOKENS + words`` plus the chat template's words.

    Returns:
        ``save_dir`` as a Path, loadable with ``from_pretrained``.
    """
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    save_dir = Path(save_dir)
    vocabulary = _vocabulary(words, SPECIAL_TOKENS, LLAVA_TEMPLATE_WORDS)
    tokenizer = word_level_tokenizer(vocabulary)
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_hidden_size,
        intermediate_size=text_intermediate_size,
        num_hidden_layers=text_layers,
        num_attention_heads=text_heads,
        num_key_value_heads=text_kv_heads or text_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    num_patches = (image_size // patch_size) ** 2
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu",
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy="default",
        image_seq_length=num_patches,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    model.save_pretrained(save_dir)
    processor.save_pretrained(save_dir)
    return save_dir


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


def build_qwen2_5_vl(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    image_size: int = 112,
    patch_size: int = 14,
    spatial_merge_size: int = 2,
    vision_hidden_size: int = 32,
    vision_intermediate_size: int = 64,
    vision_layers: int = 2,
    vision_heads: int = 2,
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    mrope_section: Sequence[int] = (2, 3, 3),
    max_position_embeddings: int = 512,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``Qwen2_5_VLForConditionalGeneration`` with its processor.

    GQA (``text_kv_heads < text_heads``) and 3-D M-RoPE (``sum(mrope_section)`` must be
    ``head_dim / 2``). By default the PIL image processor is pinned to exactly
    ``image_size**2`` pixels (min = max), so a square image gives a
    ``(image_size / (patch_size * spatial_merge_size))``-square token grid; with
    ``min_pixels`` < ``max_pixels`` images keep their own size within that range (dynamic
    resolution, rounded to ``patch_size * spatial_merge_size``). The last vision block uses
    full attention, the others windowed attention.

    Returns:
        ``save_dir`` as a Path, loadable with ``from_pretrained``.
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    save_dir = Path(save_dir)
    tokenizer = qwen_tokenizer(words)
    config = Qwen2_5_VLConfig(
        vision_config={
            "depth": vision_layers,
            "hidden_size": vision_hidden_size,
            "intermediate_size": vision_intermediate_size,
            "num_heads": vision_heads,
            "patch_size": patch_size,
            "spatial_merge_size": spatial_merge_size,
            "temporal_patch_size": 2,
            "window_size": patch_size * spatial_merge_size * 2,
            "out_hidden_size": text_hidden_size,
            "fullatt_block_indexes": [vision_layers - 1],
        },
        text_config=qwen_text_config(
            tokenizer,
            hidden=text_hidden_size,
            intermediate=text_intermediate_size,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
            mrope_section=mrope_section,
            max_positions=max_position_embeddings,
        ),
        **qwen_vision_token_ids(tokenizer),
    )
    # Qwen2_5_VLProcessor insists on a video processor, which needs torchvision; the adapter
    # composes image processor + tokenizer itself, so those two (and the template) are saved.
    return save_tiny_qwen(
        Qwen2_5_VLForConditionalGeneration,
        config,
        tokenizer,
        save_dir,
        seed=seed,
        patch_size=patch_size,
        merge_size=spatial_merge_size,
        min_pixels=min_pixels or image_size * image_size,
        max_pixels=max_pixels or image_size * image_size,
    )


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
    "build_llava",
    "build_qwen2_5_vl",
    "build_clip",
    "qwen_tokenizer",
    "SPECIAL_TOKENS",
    "QWEN_SPECIAL_TOKENS",
]
