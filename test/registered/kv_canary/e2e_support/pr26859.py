"""sglang 0.5.12's FROZEN_KV_MTP defect that upstream sglang PR 26859 fixed, worked around for
test servers (``KV_CANARY_TEST_PR26859=1``, registered by ``sitecustomize``).

When every request of a decode batch finishes in one verify, ``FrozenKVMTPWorker.
forward_batch_generation`` skips the seed step (no row to seed) and leaves the batch's
``spec_info`` the round's ``FrozenKVMTPVerifyInput``. The scheduler filters its running batch
only before a decode; when new requests wait, it runs their prefill first and then merges that
prefill into the unfiltered running batch: ``ScheduleBatch.merge_batch`` calls
``spec_info.merge_batch``, which a verify input lacks (``AttributeError``), and the server
stops. With the canary on or off; how often depends on how fast the next requests arrive.

:func:`idle_draft_input_after_all_finished` (an AFTER hook of that method) gives such a batch
the empty draft input the worker itself installs for an idle batch
(``forward_draft_extend_after_decode``), whose ``merge_batch`` takes the prefill's rows and whose
``filter_batch`` then drops the finished requests' (none). Test processes only."""

TARGET = "sglang.srt.speculative.frozen_kv_mtp_worker.FrozenKVMTPWorker.forward_batch_generation"


def idle_draft_input_after_all_finished(result, worker, batch, *args, **kwargs):
    """After a decode round whose verify finished every request: ``batch.spec_info`` the
    worker's empty ``FrozenKVMTPDraftInput``; any other batch unchanged. Returns ``result``."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.frozen_kv_mtp_info import (
        FrozenKVMTPDraftInput,
        FrozenKVMTPVerifyInput,
    )

    if isinstance(batch.spec_info, FrozenKVMTPVerifyInput):
        batch.spec_info = FrozenKVMTPDraftInput.create_idle_input(
            device=worker.device,
            hidden_size=worker._recurrent_hidden_size,
            dtype=worker.model_config.dtype,
            topk=worker.topk,
            capture_hidden_mode=CaptureHiddenMode.LAST,
        )
    return result
