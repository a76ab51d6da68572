"""The violation pipeline: what happens to a failed check, one stage per module, top to bottom
(docs/architecture.md, "Violation pipeline", and its glossary):

| stage | module | noun |
| --- | --- | --- |
| the ring's rows of one forward, decoded once; rows of one slot merged | ``records`` | *record* (one row), *incident* (one slot's records: one report) |
| the incident as a structured line and its explanation; the line's parser | ``lines`` | *line* |
| the running requests an incident touches (``rids=``) | ``resolver`` | *touched requests* |
| the mode's action: log or raise (``reporter``); abort's containment (``containment``) and its guarded release (``release_guard``) | ``reporter``, ``containment``, ``release_guard`` | *action* |
| the counters (Prometheus) | ``metrics`` | *count* |

The runner's ``ForwardReporter`` (``manager/reporting.py``) feeds each forward's read-back in.
Host only.
"""
