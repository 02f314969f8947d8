"""Tasks: the labels made per image (a caption, tags, typed JSON fields, boxes), from the
settings' `tasks`.

A task is a prompt with its own sampling, output kind and template. Placeholders in a prompt are
filled per image: {filename} (the file's name), {stem} (without its extension), {folder} (its
folder's name) and {sidecar} (the text of the image's existing sidecar caption, to refine
labels). `output: json` decodes under the task's JSON Schema (engine/grammar.py); `output: boxes`
reads Qwen3-VL's `bbox_2d` answer (0-1000 on both axes) and gives the boxes in pixels of the
image as the user sees it (after its EXIF orientation)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace

from mmcli.config import Config, SamplingParams, TaskConfig, check_prompt
from mmcli.errors import ConfigError


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    output: str
    schema: dict | None
    sampling: SamplingParams
    sidecar: str | None
    prefix: str
    suffix: str

    @property
    def definition(self) -> dict:
        """What the task's labels depend on (its part of the resume key)."""
        kept = {k: v for k, v in asdict(self).items() if k != "sidecar"}
        return {**kept, "sampling": self.sampling.as_dict()}


def decide_sampling(base: SamplingParams, own: dict, given: dict | None) -> SamplingParams:
    """Sampling precedence, decided here alone: values given (the command line, the API's keywords)
    win over a task's own, which win over `base` (the settings' generation). None is not given."""
    chosen = {k: v for k, v in own.items() if v is not None}
    chosen.update({k: v for k, v in (given or {}).items() if v is not None})
    return replace(base, **chosen)


def resolve_tasks(
    cfg: Config, names: list[str | Task] | tuple[str, ...] | None = None, given: dict | None = None
) -> list[Task]:
    """The named tasks (default: the settings' `task` list), or tasks already resolved, with their
    sampling decided by `decide_sampling`."""
    tasks = []
    for name in names or cfg.task:
        if isinstance(name, Task):  # resolved before: only sampling given now changes it
            tasks.append(
                replace(name, sampling=decide_sampling(name.sampling, {}, given)) if given else name
            )
            continue
        if name not in cfg.tasks:
            raise ConfigError(f"task {name!r} is not defined (known: {', '.join(cfg.tasks)})")
        spec: TaskConfig = cfg.tasks[name]
        own = {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature}
        prompt = spec.prompt or (cfg.prompt if name == "caption" else "")
        sampling = decide_sampling(cfg.generation, own, given)
        tasks.append(
            Task(
                name,
                prompt,
                spec.output,
                spec.schema,
                sampling,
                spec.sidecar,
                spec.prefix,
                spec.suffix,
            )
        )
    return tasks


# a plain question's task: its name seeds its sampled tokens (`ask` and `serve` alike)
QUESTION_TASK = "caption"


def question_task(cfg: Config, question: str | None, given: dict | None = None) -> Task:
    """The plain task of a question (else the settings' prompt): text out, no template."""
    if question:
        check_prompt(question, "prompt (given)")
    sampling = decide_sampling(cfg.generation, {}, given)
    return Task(QUESTION_TASK, question or cfg.prompt, "text", None, sampling, None, "", "")


def _json_text(text: str) -> str:
    """The JSON inside an answer, without a ```json fence around it."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    return (fenced.group(1) if fenced else text).strip()


def boxes_in_pixels(text: str, width: int, height: int) -> list[dict]:
    """Qwen3-VL's boxes ({"bbox_2d": [x1, y1, x2, y2], "label": ...}, 0-1000 on both axes) in
    pixels of a width x height image; raises ValueError when the answer holds no such boxes."""
    data = json.loads(_json_text(text))
    data = [data] if isinstance(data, dict) else data
    boxes = []
    for entry in data:
        x1, y1, x2, y2 = (float(v) for v in entry["bbox_2d"])
        boxes.append(
            {
                "label": entry.get("label"),
                "bbox": [
                    round(x1 * width / 1000, 1),
                    round(y1 * height / 1000, 1),
                    round(x2 * width / 1000, 1),
                    round(y2 * height / 1000, 1),
                ],
            }
        )
    return boxes


def finish(task: Task, text: str, width: int | None, height: int | None) -> dict:
    """A finished answer's record fields: `text` wrapped in the template, and `json` or `boxes`
    as the output asks; raises ValueError with the reason when the answer is not what the output
    needs."""
    fields: dict = {"text": f"{task.prefix}{text}{task.suffix}"}
    if task.prefix or task.suffix:
        fields["raw_text"] = text
    if task.output == "json":
        fields["json"] = json.loads(text)
    elif task.output == "boxes":
        try:
            fields["boxes"] = boxes_in_pixels(text, width or 0, height or 0)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the answer holds no bbox_2d boxes ({str(e)[:120]})") from None
    return fields
