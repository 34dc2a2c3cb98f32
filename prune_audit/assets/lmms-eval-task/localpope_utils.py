import io

from PIL import Image


def doc_to_visual(doc):
    image = doc["image"]
    if isinstance(image, dict):
        image = Image.open(io.BytesIO(image["bytes"]))
    return [image.convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    return {"accuracy": float(results[0].strip().lower().startswith(doc["answer"]))}


ROUNDS = 2


def doc_to_text_rounds(doc, lmms_eval_specific_kwargs=None, previous_output=None, round_idx=None,
                       previous_round_info=None):
    """Round 0: the question; round 1: the same image asked again, quoting the first answer; then stop."""
    if round_idx is None:
        return doc["question"]
    if round_idx >= ROUNDS:
        return None, None, True, previous_output, None
    return doc_to_visual(doc), f"You said {previous_output[-1]}. {doc['question']}", False, previous_output, None


def process_results_rounds(doc, results):
    return {"accuracy": float(results[0][-1].strip().lower().startswith(doc["answer"]))}


def process_results_caption(doc, results):
    return {"words": float(len(results[0].split()))}
