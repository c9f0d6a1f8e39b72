"""A word-level tokenizer built from a caption vocabulary: the embedded default needs one and may not download.

CLIP's own BPE tokenizer lives on the Hub; the synthetic captions use a few dozen words, so a word-level
vocabulary is exact, tiny, and built in milliseconds. The result is a `PreTrainedTokenizerFast` that pads,
truncates, saves and reloads like any Hugging Face tokenizer, and follows CLIP's framing:
`<start_of_text> words ... <end_of_text> <pad>...`, where the text tower pools at the first `<end_of_text>`.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<start_of_text>", "<end_of_text>", "<pad>", "<unk>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)


def build_word_tokenizer(words: Iterable[str], model_max_length: int = 16) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `words` (lower-cased, split on whitespace and punctuation).

    Ids: 0 <pad>, 1 <unk>, 2 <start_of_text>, 3 <end_of_text>, then the words in sorted order, so the same
    vocabulary always gives the same ids (checkpoints stay loadable across runs).
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in sorted({w.lower() for w in words} - set(vocab)):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
    )
