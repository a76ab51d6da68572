"""Planted defects, second part: the paths a forward takes (speculative modes, piecewise and
eager graphs, the read-back), the benchmarks' statistics, containment's release guard and the
memory accounting. Joined with ``mutants_checks.py`` in ``mutants.py``."""

from __future__ import annotations

from mutant_types import _KN, _RT, _SPEC_MODE_SKIPS, _T, Mutant

MUTANTS_PATHS = (
    *_SPEC_MODE_SKIPS,
    Mutant(
        id="spec-draft-token-offset-0",
        path=f"{_RT}/ranks.py",
        old="        return 1 if self.draft and self.draft_worker not in SAME_POSITION_DRAFT_WORKERS else 0\n",
        new="        return 0\n",
        selection=f"{_T}/test_speculative_install.py::test_install_canary_guards_the_draft_runner",
        speed="quick",
        what="the draft pool compares position p with token p, not p + 1",
    ),
    Mutant(
        id="spec-draft-forwards-share-sfm-0",
        path=f"{_RT}/manager/draft_rounds.py",
        old="        draft_round.next_forward += 1\n"
        "        with self.with_active_single_forward_manager(index):\n",
        new="        draft_round.next_forward += 1\n"
        "        with self.with_active_single_forward_manager(0):\n",
        selection=f"{_T}/test_speculative.py::test_draft_rounds_through_the_plugin_hooks",
        speed="quick",
        what="every forward of a draft round uses single-forward manager 0",
    ),
    Mutant(
        id="spec-plugin-no-draft-round-branch",
        path=f"{_RT}/plugin.py",
        old="    if manager.in_draft_round:  # one forward of an EAGLE draft round\n",
        new="    if False:  # one forward of an EAGLE draft round\n",
        selection=f"{_T}/test_speculative.py::test_draft_rounds_through_the_plugin_hooks",
        speed="quick",
        what="ModelRunner.forward hook ignores the draft round",
    ),
    Mutant(
        id="spec-strided-slots-passed-through",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="        if out_cache_loc.is_contiguous():\n",
        new="        if True:\n",
        selection=f"{_T}/test_speculative.py::test_eagle_rounds_run_clean_with_token_checks",
        speed="quick",
        what="a draft forward's strided slots reach the write launches",
    ),
    Mutant(
        id="spec-v1-draft-extend-keeps-finished-reqs",
        path=f"{_RT}/sglang_seam/scheduler.py",
        old="        reqs = [r for r in reqs if not r.finished()]\n",
        new="        pass\n",
        selection=f"{_T}/test_plugin_hooks.py::"
        "test_spec_v1_draft_extend_snapshots_only_the_unfinished_requests",
        speed="quick",
        what="spec v1's draft extend snapshots the round's finished requests",
    ),
    Mutant(
        id="raise-message-without-rank",
        path=f"{_RT}/manager/reporting.py",
        old='                rank=ranks.describe_rank() if ranks.several else "",\n',
        new='                rank="",\n',
        selection=f"{_T}/test_runtime_core.py::test_raise_names_the_rank_on_a_server_of_several",
        speed="quick",
        what="raise mode's error does not say which rank found the corruption",
    ),
    Mutant(
        id="spec-fault-worker-target-ignored",
        path=f"{_RT}/perturb/config.py",
        old='            and self.target_worker in (None, worker)\n',
        new='',
        selection=f"{_T}/test_speculative.py::test_perturbation_can_target_the_draft_worker_only",
        speed="quick",
        what="SGLANG_KV_CANARY_PERTURB_TARGET_WORKER is ignored",
    ),
    Mutant(
        id="spec-draft-reports-unnamed",
        path=f"{_RT}/manager/reporting.py",
        old='                pool=draft_pool_label(ranks.draft_worker) if ranks.draft else "",\n',
        new='                pool="",\n',
        selection=f"{_T}/test_speculative.py::test_a_flipped_byte_is_caught_by_its_pool_canary",
        speed="quick",
        what="a draft-pool report does not say it is the draft pool",
    ),
    Mutant(
        id="piecewise-replay-reads-padded-batch",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="        if self._capturing:\n            return forward_batch\n",
        new="        if True:\n            return forward_batch\n",
        selection=f"{_T}/test_piecewise.py::"
        "test_a_padded_piecewise_replay_is_checked_as_the_scheduler_sent_it",
        speed="quick",
        what="a piecewise replay's inside ops read sglang's padded copy",
    ),
    Mutant(
        id="piecewise-set-up-runs-the-canary",
        path=f"{_RT}/manager/canary_manager.py",
        old="        if not self._piecewise_graph_setup:\n"
        "            self.active_sfm.pre_ops_maybe_inside_graph(forward_batch)\n",
        new="        if True:\n"
        "            self.active_sfm.pre_ops_maybe_inside_graph(forward_batch)\n",
        selection=f"{_T}/test_piecewise.py::test_piecewise_set_up_forwards_run_no_canary_work",
        speed="quick",
        what="piecewise warm-up / capture forwards reach the canary",
    ),
    Mutant(
        id="token-upload-before-the-forward",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="        self._tokens_pending = self.token_history is not None\n",
        new="        self._tokens_pending = self.token_history is not None\n"
        "        self.upload_tokens_before_replay()\n",
        selection=f"{_T}/test_token_verify.py::"
        "test_an_eager_forward_uploads_the_tokens_after_the_models_launches",
        speed="quick",
        what="the token upload is back on the forward's critical path",
    ),
    Mutant(
        id="token-snapshot-at-batch-build",
        path=f"{_RT}/manager/canary_manager.py",
        old="            self.token_history.defer_snapshot(state, reqs)\n",
        new="            self.token_history.snapshot(state, reqs)\n",
        selection=f"{_T}/test_token_verify.py::test_manager_hook_fills_the_batch_state",
        speed="quick",
        what="the token snapshot is taken where the batch is built",
    ),
    Mutant(
        id="graph-replay-without-token-upload",
        path=f"{_RT}/plugin.py",
        old="        manager.before_graph_replay()  # the token-history upload the graph reads\n",
        new="        pass\n",
        selection=f"{_T}/test_plugin_hooks.py::"
        "test_graph_replay_hook_uploads_the_tokens_before_the_replay",
        speed="quick",
        what="a decode graph replays before the token upload",
    ),
    Mutant(
        id="eager-graphs-stale-rows-kept",
        path=f"{_RT}/plan_input.py",
        old="            put(rows + 8 * bs, self._rows_filled - bs, STAGE_OP_FILL, 0, 0)\n",
        new="            pass\n",
        selection=f"{_T}/test_eager_graphs.py::"
        "test_staging_zeroes_only_the_rows_a_larger_batch_left "
        f"{_T}/test_eager_graphs.py::"
        "test_static_padded_inputs_leave_the_same_records_as_the_batch_tensors",
        speed="quick",
        what="static eager launches re-plan the rows of a larger earlier batch",
    ),
    Mutant(
        id="eager-graphs-stale-slots-kept",
        path=f"{_RT}/single_forward_manager/eager_graphs.py",
        old="            put(slots + 8 * n, self._tokens_filled - n, STAGE_OP_FILL, 0, 0)\n",
        new="            pass\n",
        selection=f"{_T}/test_eager_graphs.py::"
        "test_a_smaller_batch_pads_the_rows_and_slots_a_larger_one_left",
        speed="quick",
        what="static eager slots past the forward keep an earlier forward's",
    ),
    Mutant(
        id="eager-graphs-positions-unstaged",
        path=f"{_RT}/single_forward_manager/eager_graphs.py",
        old='        put(positions, n, *stage_source(forward_batch.positions, n, "positions", index))\n',
        new="",
        selection=f"{_T}/test_eager_graphs.py::"
        "test_static_padded_inputs_leave_the_same_records_as_the_batch_tensors",
        speed="quick",
        what="static eager launches read stale positions",
    ),
    Mutant(
        id="eager-graphs-token-scatter-left-out",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old='            self.token_history.launch_replay_scatter(rpi, self.expected_valid_lens[: rpi.shape[0]])\n',
        new='            pass\n',
        selection=f"{_T}/test_eager_graphs.py::"
        "test_static_padded_inputs_leave_the_same_records_as_the_batch_tensors",
        speed="quick",
        what="an eager forward's graph does not scatter the staged token history",
    ),
    Mutant(
        id="stage-source-int32-read-as-int64",
        path=f"{_RT}/plan_input.py",
        old="    return (STAGE_A_INT32 if dtype is torch.int32 else STAGE_OP_COPY), t.data_ptr()\n",
        new="    return STAGE_OP_COPY, t.data_ptr()\n",
        selection=f"{_T}/test_eager_graphs.py::"
        "test_plan_input_normalises_each_mode_from_sglang_dtypes",
        speed="quick",
        what="the staging table reads sglang's int32 lengths as int64",
    ),
    Mutant(
        id="stage-kernel-int32-b-read-as-int64",
        path=f"{_KN}/stage_inputs.py",
        old="                    if (kind & B_INT32) != 0:\n",
        new="                    if (kind & B_INT32) == 12345:\n",
        selection=f"{_T}/test_eager_graphs.py::"
        "test_the_staging_kernel_and_its_reference_stage_the_same_values",
        speed="quick",
        what="the staging kernel's differences read an int32 second source as int64",
    ),
    Mutant(
        id="snapshot-buffer-reused-while-held",
        path=f"{_RT}/snapshot_buffers.py",
        old="        return (user is None or user() is None) and (copy is None or copy.query())\n",
        new="        return copy is None or copy.query()\n",
        selection=f"{_T}/test_token_verify.py::"
        "test_snapshot_buffers_are_reused_only_once_their_snapshot_is_gone",
        speed="quick",
        what="a token snapshot's host buffer is handed out while the snapshot may be uploaded",
    ),
    Mutant(
        id="pd-transfer-after-the-first-read",
        path=f"{_RT}/perturb/perturber.py",
        old="            if row is not None and id(req) not in read and not self._faked_transfer(req)\n",
        new="            if row is not None and not self._faked_transfer(req)\n",
        selection=f"{_T}/test_perturb_oracle.py::"
        "test_pd_transfer_fault_hits_a_prefix_at_its_first_read_and_is_caught_there",
        speed="quick",
        what="the pd_transfer fault lands after the received prefix was first read",
    ),
    # ---- session 8: packed read-back, packed token upload -------------------------------------
    Mutant(
        id="readback-one-buffer",
        path=f"{_RT}/manager/device_host.py",
        old="        self._flip ^= 1\n",
        new="",
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_device_host_handler_packs_mixed_dtypes_into_one_buffer",
        speed="quick",
        what="a stage overwrites the read-back the consumer has not read yet",
    ),
    Mutant(
        id="readback-unaligned-layout",
        path=f"{_RT}/manager/device_host.py",
        old="    order = sorted(range(len(leaves)), key=lambda i: -leaves[i].element_size())\n",
        new="    order = list(range(len(leaves)))\n",
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_device_host_handler_packs_mixed_dtypes_into_one_buffer",
        speed="quick",
        what="packed read-back places an int64 tensor after an int32 one",
    ),
    Mutant(
        id="replay-scatter-not-captured",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="                if self._capturing and self.token_history is not None:\n",
        new="                if False:\n",
        selection=f"{_T}/test_graph_replay_cpu.py::"
        "test_replayed_decodes_leave_the_records_of_eager_decodes",
        speed="quick",
        what="a replayed decode's tokens never reach the expected-token pool",
    ),
    Mutant(
        id="packed-scatter-padding-lens-kept",
        path=f"{_KN}/scatter_req_token_ids.py",
        old="    elif split == 0:\n        tl.store(lens_ptr + r, 0)\n",
        new="",
        selection=f"{_T}/test_kernels_fuzz.py::test_packed_scatter_matches_reference_and_definition",
        speed="quick",
        what="a graph's padding rows keep a stale valid length",
    ),
    Mutant(
        id="replay-staging-stale-snapshot",
        path=f"{_RT}/token_history.py",
        old="        elif snap is self._replay_holds:\n",
        new="        elif self._replay_holds is not None:\n",
        selection=f"{_T}/test_token_verify.py::test_replay_staging_copies_once_per_snapshot "
        f"{_T}/test_graph_replay_cpu.py::"
        "test_replayed_decodes_leave_the_records_of_eager_decodes",
        speed="quick",
        what="a replay reads the snapshot staged for an earlier one",
    ),
    # ---- the interleaved benchmark's statistics ----------------------------------------------
    Mutant(
        id="interleaved-no-abba",
        path="benchmark/kv_canary/interleaved_rounds.py",
        old="    return order if (k // len(names)) % 2 == 0 else order[::-1]",
        new="    return list(names)",
        selection=f"{_T}/test_bench_interleaved.py::"
        "test_rounds_rotate_each_server_through_each_place_and_memory_shares_accumulate "
        f"{_T}/test_bench_interleaved.py::"
        "test_measure_sends_each_round_to_every_server_in_rotating_order",
        speed="quick",
        what="every round visits the servers in one order",
    ),
    Mutant(
        id="interleaved-mean-ratio",
        path="benchmark/kv_canary/interleaved_rounds.py",
        old="    return statistics.median(ratios), quantile(meds, 0.025)",
        new="    return statistics.mean(ratios), quantile(meds, 0.025)",
        selection=f"{_T}/test_bench_interleaved.py::"
        "test_paired_overhead_is_the_median_ratio_with_a_bootstrap_interval",
        speed="quick",
        what="one outlier round moves the reported overhead",
    ),
    Mutant(
        id="interleaved-mismatch-uncounted",
        path="benchmark/kv_canary/interleaved_rounds.py",
        old="    return int(k >= 0 and any(len(seen) > 1 for seen in by_stack.values()))\n",
        new="    return 0\n",
        selection=f"{_T}/test_bench_interleaved.py::"
        "test_measure_sends_each_round_to_every_server_in_rotating_order",
        speed="quick",
        what="a config that changes greedy outputs goes unnoticed",
    ),
    Mutant(
        id="guard-ignores-holders",
        path=f"{_RT}/violations/release_guard.py",
        old="        ok = ~was_free & (~other | (fits & ~has_orphan))\n",
        new="        ok = ~was_free\n",
        selection=f"{_T}/test_release_guard.py::test_a_page_the_radix_cache_holds_is_held_back",
        speed="quick",
        what="an aborted request frees a page another holder names",
    ),
    Mutant(
        id="guard-holds-back-its-own",
        path=f"{_RT}/violations/release_guard.py",
        old="        ok = ~was_free & (~other | (fits & ~has_orphan))\n",
        new="        ok = ~was_free & ~other\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_third_holder_of_identical_records_keeps_its_page",
        speed="quick",
        what="a request holds back its own slot another's corrupt row names with identical "
        "records (sglang's busy check sees a leak)",
    ),
    Mutant(
        id="guard-trusts-identical-records",
        path=f"{_RT}/violations/release_guard.py",
        old="        ok = ~was_free & (~other | (fits & ~has_orphan))\n",
        new="        ok = ~was_free & (~other | fits)\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_identical_prefixes_make_the_other_holders_slot_look_like_the_requests_own",
        speed="quick",
        what="an identical record makes another holder's slot the request's",
    ),
    Mutant(
        id="guard-page-mates-unattributed",
        path=f"{_RT}/violations/release_guard.py",
        old="            unattributed = int((lost & ~torch.isin(keys, rec_keys[mine])).sum())\n",
        new="            unattributed = int(lost.sum())\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_corrupt_entry_whose_page_mates_free_its_own_page_is_attributed",
        speed="quick",
        what="a slot freed with its page mates is reported unattributed",
    ),
    Mutant(
        id="guard-no-reclaim",
        path=f"{_RT}/violations/release_guard.py",
        old="        if plan.reclaim.numel():\n",
        new="        if False:\n",
        selection=f"{_T}/test_release_guard.py::test_a_row_naming_its_own_slot_twice_frees_it_once",
        speed="quick",
        what="the slot a corrupt row lost stays allocated",
    ),
    Mutant(
        id="guard-no-dedupe",
        path=f"{_RT}/violations/release_guard.py",
        old="            if page_size == 1:\n                idx = torch.unique(idx)\n",
        new="",
        selection=f"{_T}/test_release_guard.py::test_a_row_naming_its_own_slot_twice_frees_it_once",
        speed="quick",
        what="a slot a row names twice is freed twice",
    ),
    Mutant(
        id="guard-settle-frees-nothing",
        path=f"{_RT}/violations/release_guard.py",
        old="            orphans = pending[~named[pending] & ~free[pending]].tolist()\n",
        new="            orphans = []\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_held_back_page_no_holder_names_any_more_is_freed_by_settle",
        speed="quick",
        what="a held-back page nobody holds any more is lost",
    ),
    Mutant(
        id="guard-hook-off",
        path=f"{_RT}/plugin.py",
        old="    guard = seam.release_guard_of(self) if seam.req_contained(req) else None\n",
        new="    guard = None\n",
        selection=f"{_T}/test_release_guard.py::test_a_chunk_cache_release_is_guarded_too",
        speed="quick",
        what="no release is guarded",
    ),
    Mutant(
        id="guard-eviction-unguarded",
        path=f"{_RT}/violations/containment.py",
        old="                with guard:\n                    freed = seam.radix_evict_subtree(",
        new="                with contextlib.nullcontext():\n"
        "                    freed = seam.radix_evict_subtree(",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_corrupt_row_sglang_cached_before_its_report_is_evicted_under_the_guard",
        speed="quick",
        what="abort mode's eviction frees a live request's slot a cached "
        "corrupt row put in the tree",
    ),
    Mutant(
        id="guard-corrupt-row-keeps-a-page",
        path=f"{_RT}/violations/release_guard.py",
        old="        other, was_free = kept[pages], free[pages]\n",
        new="        other, was_free = named[pages], free[pages]\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_an_evicted_prefix_frees_a_page_a_corrupt_row_names_though_a_sibling_branch_starts_alike",
        speed="quick",
        what="a live row's corrupt entry keeps a page of an evicted prefix (sglang's busy "
        "check sees a page missing)",
    ),
    Mutant(
        id="guard-nests",
        path=f"{_RT}/violations/release_guard.py",
        old="        if self._busy or row is None or hi <= lo:\n",
        new="        if row is None or hi <= lo:\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_guard_nested_in_a_guarded_release_leaves_it_to_the_outer_one",
        speed="quick",
        what="a release hooked twice reclaims the lost slot twice",
    ),
    Mutant(
        id="kept-fault-undone",
        path=f"{_RT}/perturb/perturber.py",
        old="        if kind == FaultKind.REQ_TO_TOKEN:\n",
        new="        if True:\n",
        selection=f"{_T}/test_perturb_oracle.py::"
        "test_the_kept_req_to_token_fault_stays_and_picks_requests_with_tokens_left",
        speed="quick",
        what="the kept req_to_token fault is undone like the other",
    ),
    Mutant(
        id="kept-fault-one-entry-per-page",
        path=f"{_RT}/perturb/perturber.py",
        old="            if self.page_size > 1:\n",
        new="            if False:\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_the_kept_fault_loses_the_requests_own_page_and_the_guard_reclaims_it",
        speed="quick",
        what="the kept fault rewrites one entry at page size 16 (its page "
        "stays named by its page mates: nothing for the guard to reclaim)",
    ),
    Mutant(
        id="kept-fault-page-size-ignored",
        path=f"{_RT}/manager/canary_manager.py",
        old='page_size=(sglang_seam.kv_pool_page_size(kv_pool) if kv_pool is not None else 1),',
        new='page_size=(1 and 1 if kv_pool is not None else 1),',
        selection=f"{_T}/test_perturb_oracle.py::test_the_kept_fault_rewrites_in_the_pools_pages",
        speed="quick",
        what="the perturber is not told the pool's page size",
    ),
    Mutant(
        id="memory-v-records-uncounted",
        path=f"{_RT}/memory.py",
        old="            add(device, MemoryPart.RECORDS, 2 * g.record_halves * g.slots * CANARY_SLOT_BYTES)\n",
        new="            add(device, MemoryPart.RECORDS, 2 * g.slots * CANARY_SLOT_BYTES)\n",
        selection=f"{_T}/test_memory.py::test_the_formula_counts_every_tensor_a_built_canary_holds"
        "[mha_v_layers_tokens_sweep]",
        speed="quick",
        what="the V half's records are left out of the canary's memory",
    ),
    Mutant(
        id="memory-plans-once",
        path=f"{_RT}/memory.py",
        old="        for _ in range(inputs.single_forward_managers):\n",
        new="        for _ in range(1):\n",
        selection=f"{_T}/test_memory.py::"
        "test_the_formula_counts_each_single_forward_manager_and_the_write_input_check[3]",
        speed="quick",
        what="an EAGLE draft canary's managers counted as one",
    ),
    Mutant(
        id="memory-budget-not-cut",
        path=f"{_RT}/memory_budget.py",
        old="        if tokens is not None and mid + total(memories) <= available_bytes:\n",
        new="        if tokens is not None and mid <= available_bytes:\n",
        selection=f"{_T}/test_memory.py::"
        "test_the_kv_budget_shrinks_by_exactly_the_canarys_bytes[1-config0]",
        speed="quick",
        what="the KV pool keeps its whole budget (the canary comes on top)",
    ),
    Mutant(
        id="memory-prediction-no-padding-page",
        path=f"{_RT}/memory_budget.py",
        old="    full_slots = tokens.max_total + page_size\n",
        new="    full_slots = tokens.max_total\n",
        selection=f"{_T}/test_memory.py::"
        "test_the_predicted_groups_are_the_groups_the_adapters_build[mha]",
        speed="quick",
        what="the predicted pool lacks sglang's padding page",
    ),
    Mutant(
        id="memory-gauge-unset",
        path=f"{_RT}/manager/scheduler_side.py",
        old="            reporter.metrics.set_memory(self.memory, draft=self.ranks.draft)\n",
        new="            pass\n",
        selection=f"{_T}/test_memory.py::test_the_gauge_exports_the_bytes_by_part",
        speed="quick",
        what="sglang:kv_canary_memory_bytes is never set",
    ),
    Mutant(
        id="memory-host-pool-unshrunk",
        path=f"{_RT}/memory_budget.py",
        old="    share = kv / (kv + mirror)\n",
        new="    share = 1.0\n",
        selection=f"{_T}/test_deep_fingerprints.py::test_host_tier_mirror_on_real_pools",
        speed="quick",
        what="HiCache's host pool keeps its KV budget (the mirror comes on top)",
    ),
)
