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
