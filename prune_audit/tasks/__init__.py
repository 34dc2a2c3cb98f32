"""Tasks: the kinds of question a run audits, behind one seam, with a registry.

>>> from prune_audit.tasks import get_task, list_tasks
>>> list_tasks()  # doctest: +SKIP
['pope', ...]

Built-in tasks register on import of this package; plugins register under the entry-point
group ``prune_audit.tasks``. Layering: tasks use ``data``, ``answer_modes`` and ``record_columns`` (each task
declares its own record columns); ``records`` sits above them and assembles the run schema from this registry
(``records.schema.run_columns``); the runner, the record builder and the analyses use tasks.
"""

from importlib import import_module

from prune_audit.tasks.base import AnsweringModel, Evidence, FigureBoxes, Scored, Task, TaskQuestion
from prune_audit.tasks.registry import DEFAULT_TASK, get_task, list_tasks, manifest_task, register_task

# one module per task; importing it registers the task. The order is that of the tasks' record columns in every
# records file (records.schema.run_columns): append a new task, never reorder
_TASKS = ["pope", "caption", "gqa", "scienceqa", "textvqa", "refcoco", "video_mc", "video_presence"]
for _module in _TASKS:
    import_module(f"prune_audit.tasks.{_module}")

__all__ = [
    "DEFAULT_TASK",
    "AnsweringModel",
    "Evidence",
    "FigureBoxes",
    "Scored",
    "Task",
    "TaskQuestion",
    "get_task",
    "list_tasks",
    "manifest_task",
    "register_task",
]
