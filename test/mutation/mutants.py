"""The planted defects of the mutation check (docs/architecture.md, "Mutation check"), read by
``run_mutants.py`` and kept well-formed by ``test/registered/kv_canary/test_mutants_list.py``.

Each :class:`Mutant` is one realistic single defect: replace ``old`` (which must occur exactly
once in ``path``) with ``new``, and ``selection`` (pytest node ids, space separated, relative to
the repository root) must then fail. ``speed`` says whether the selection is in the quick
subset (``-m "not slow"``) or needs the slow end-to-end suites.

The list grows with each capability: a new check, hook or validation comes with the defect
that would switch it off silently, and the test that notices it.
"""

from __future__ import annotations

import dataclasses

_T = "test/registered/kv_canary"
_RT = "python/sglang/srt/kv_canary"
_KN = "python/sglang/jit_kernel/kv_canary"


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # relative to the repository root
    old: str  # exact text, found exactly once in ``path``
    new: str
    selection: str  # pytest node ids that must fail with the mutant planted
    speed: str  # "quick" (in -m "not slow") or "slow"
    what: str  # the defect, in a few words


def _spec_mode_skips(label: str, mode: str, what: str) -> tuple:
    """A speculative forward mode's verify, and its write, skipped for the forwards of
    ``mode`` (a ``ForwardMode`` name), each killed by that mode's test of
    ``test_speculative.py``."""
    guard = (
        f"        if self._batch is not None and self._batch.forward_mode.name == "
        f"\"{mode}\":\n            return\n"
    )
    sfm = f"{_RT}/single_forward_manager/manager.py"
    verify = "    def _verify(self, phase: CanaryPhase) -> None:\n"
    write = "        self._write_lanes.run(\n            chain_write_launches(\n"
    name = label.replace("_", "-")
    return (
        Mutant(
            id=f"spec-{name}-verify-skipped",
            path=sfm,
            old=verify,
            new=verify + guard,
            selection=f"{_T}/test_speculative.py::"
            f"test_each_speculative_forward_mode_verifies_what_it_reads[{label}]",
            speed="quick",
            what=f"{what} verifies nothing (a later forward catches its faults)",
        ),
        Mutant(
            id=f"spec-{name}-write-skipped",
            path=sfm,
            old=write,
            new=guard + write,
            selection=f"{_T}/test_speculative.py::"
            f"test_each_speculative_forward_mode_writes_the_records_of_its_slots"
            f"[{label}]",
            speed="quick",
            what=f"{what} writes no records",
        ),
    )


_SPEC_MODE_SKIPS = (
    *_spec_mode_skips("target_verify", "TARGET_VERIFY", "the target verify"),
    *_spec_mode_skips("draft_decode", "DECODE", "a draft round's decode"),
    *_spec_mode_skips("draft_extend", "DRAFT_EXTEND", "spec v1's draft extend"),
    *_spec_mode_skips("draft_extend_v2", "DRAFT_EXTEND_V2", "spec v2's draft extend"),
)


MUTANTS = (
    # ---- the audit's rows --------------------------------------------------------------------
    Mutant(
        id="row1-sweep-swa-untranslated",
        path=f"{_RT}/runner/sweep.py",
        old='swa_index_lut=ep.group.swa_index_lut\n',
        new='swa_index_lut=None\n',
        selection=f"{_T}/test_radix_sweep.py::"
        "test_sweep_of_a_swa_pool_reads_the_swa_records_through_the_table",
        speed="quick",
        what="sweep reads SWA records at FULL slot indices",
    ),
    Mutant(
        id="row2-chain-position-never-on",
        path=f"{_RT}/state.py",
        old="self.enable_chain_position_assert.fill_(1)",
        new="self.enable_chain_position_assert.fill_(0)",
        selection=f"{_T}/test_runtime_core.py::"
        "test_a_write_at_a_wrong_position_is_reported_only_after_init_finished",
        speed="quick",
        what="mark_init_finished leaves the chain-position check off",
    ),
    Mutant(
        id="row3-target-verify-prefix",
        path=f"{_RT}/plan_input.py",
        old="src.append(leading(forward_batch.seq_lens, bs))",
        new="src.append(leading(forward_batch.seq_lens, bs) - 1)",
        selection=f"{_T}/test_runtime_core.py::"
        "test_target_verify_forward_plans_from_the_committed_prefix",
        speed="quick",
        what="TARGET_VERIFY prefix is seq_lens - 1",
    ),
    Mutant(
        id="row4-replaced-input-list",
        path=f"{_RT}/token_history.py",
        old='                    and o[1] is origin_ids\n',
        new='',
        selection=f"{_T}/test_token_verify.py::test_a_replaced_input_list_is_sent_whole",
        speed="quick",
        what="a replaced origin_input_ids list is not re-snapshotted",
    ),
    Mutant(
        id="row5-overflow-not-warned",
        path=f"{_RT}/runner/overflow.py",
        old="if int(e) != 1)",
        new="if int(e) not in (0, 1))",
        selection=f"{_T}/test_runtime_seams.py::"
        "test_overflow_and_divergence_are_read_against_the_right_group"
        "[full_by_overflow-False]",
        speed="quick",
        what="a disabled (overflowed) plan is never warned about",
    ),
    Mutant(
        id="row6a-env-probability-1.5",
        path=f"{_RT}/envs.py",
        old="if not 0.0 <= value <= 1.0:",
        new="if not 0.0 <= value <= 2.0:",
        selection=f"{_T}/test_config.py::"
        "test_the_variable_parser_alone_refuses_a_probability_above_one",
        speed="quick",
        what="the variable parser accepts a probability of 1.5",
    ),
    Mutant(
        id="row6b-perturb-config-probability-1.5",
        path=f"{_RT}/perturb/config.py",
        old="not 0.0 <= p <= 1.0:",
        new="not 0.0 <= p <= 2.0:",
        selection=f"{_T}/test_config.py::test_perturb_config_alone_refuses_a_probability_above_one",
        speed="quick",
        what="PerturbConfig accepts a probability of 1.5",
    ),
    Mutant(
        id="row7-request-capacity-off-by-one",
        path=f"{_RT}/single_forward_manager/manager.py",
        old="if bs > caps.write_req_capacity:",
        new="if bs >= caps.write_req_capacity:",
        selection=f"{_T}/test_runtime_core.py::test_a_forward_of_exactly_the_request_capacity_runs",
        speed="quick",
        what="a forward of exactly the request capacity is refused",
    ),
    Mutant(
        id="row8-init-hook-never-marks",
        path=f"{_RT}/plugin.py",
        old="    if manager is not None and not seam.is_draft_worker(self):\n"
        "        manager.mark_init_finished()\n",
        new="    if manager is not None and not seam.is_draft_worker(self):\n        pass\n",
        selection=f"{_T}/test_plugin_hooks.py::"
        "test_model_runner_init_hook_turns_the_chain_position_check_on",
        speed="quick",
        what="ModelRunner.__init__ hook never calls mark_init_finished",
    ),
    Mutant(
        id="row9-scheduler-hook-no-radix",
        path=f"{_RT}/plugin.py",
        old="radix_cache=seam.scheduler_tree_cache(self),",
        new="radix_cache=None,",
        selection=f"{_T}/test_plugin_hooks.py::"
        "test_scheduler_hook_hands_the_radix_cache_to_the_sweep",
        speed="quick",
        what="Scheduler hook never attaches the radix cache (no sweep)",
    ),
    Mutant(
        id="row10-init-new-hook-no-snapshot",
        path=f"{_RT}/plugin.py",
        old="manager.on_forward_batch_init(result, seam.schedule_batch_reqs(batch))",
        new="pass",
        selection=f"{_T}/test_plugin_hooks.py::test_forward_batch_hook_snapshots_real_requests "
        f"{_T}/test_plugin_hooks.py::"
        "test_forward_batch_hook_feeds_the_token_checks_of_a_serving_loop",
        speed="quick",
        what="ForwardBatch.init_new hook never attaches the token snapshot",
    ),
    # ---- kernel references (the CPU serving path and the kernels' oracle) -------------------
    Mutant(
        id="ref-verify-chain-head-unchecked",
        path=f"{_KN}/verify_ref.py",
        old="check_chain = has_prev_rec | (prev == NO_PREV_SLOT)",
        new="check_chain = has_prev_rec",
        selection=f"{_T}/test_kernels_hand.py::test_verify_overflow_disables_plan[torch_ref]",
        speed="quick",
        what="verify reference skips the chain check of position 0",
    ),
    Mutant(
        id="ref-write-seed-zero-checked",
        path=f"{_KN}/write_ref.py",
        old='seed_ok & (seeds > 0) & bool(',
        new='seed_ok & (seeds >= 0) & bool(',
        selection=f"{_T}/test_kernels_hand.py::"
        "test_write_seed_zero_is_not_position_checked[torch_ref]",
        speed="quick",
        what="write reference position-checks from the padding slot 0",
    ),
    Mutant(
        id="ref-plan-swa-window-short",
        path=f"{_KN}/plan_ref.py",
        old="ws = (pl - swa_window_size).clamp_min(0)",
        new="ws = (pl - swa_window_size + 1).clamp_min(0)",
        selection=f"{_T}/test_kernels_hand.py::test_swa_window_with_evicted_slots[torch_ref]",
        speed="quick",
        what="plan reference verifies one SWA position fewer than the window",
    ),
    # ---- runtime ------------------------------------------------------------------------------
    Mutant(
        id="rt-merge-incidents-last-reason",
        path=f"{_RT}/runner/violation_record.py",
        old="entry[1] |= rec.fail_bits",
        new="entry[1] = rec.fail_bits",
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_an_incident_unites_the_reasons_of_all_its_rows",
        speed="quick",
        what="merged incident keeps the last row's reasons only",
    ),
    Mutant(
        id="rt-ring-not-emptied",
        path=f"{_RT}/runner/manager.py",
        old='zero_after_copy=(log.violation_write_index,),',
        new='zero_after_copy=(),',
        selection=f"{_T}/test_runtime_core.py::test_ring_is_detailed_again_after_a_full_window",
        speed="quick",
        what="the violation ring is never emptied between forwards",
    ),
    Mutant(
        id="rt-perturb-req-to-token-not-undone",
        path=f"{_RT}/perturb/perturber.py",
        old="self._undo.append(lambda: r2t.__setitem__((row, pos), old))",
        new="pass",
        selection=f"{_T}/test_perturb_oracle.py::"
        "test_before_forward_faults_are_undone_after_the_forward_read_them",
        speed="quick",
        what="the req_to_token fault is left in place after the forward",
    ),
    # ---- configuration validation -------------------------------------------------------------
    Mutant(
        id="cfg-ring-capacity-zero",
        path=f"{_RT}/config.py",
        old='("ring_capacity", 1, MAX_RING_CAPACITY)',
        new='("ring_capacity", 0, MAX_RING_CAPACITY)',
        selection=f"{_T}/test_config.py::test_config_integer_fields_are_range_checked",
        speed="quick",
        what="CanaryConfig accepts a ring capacity of 0",
    ),
    Mutant(
        id="cfg-unused-cache-fault-without-sweep",
        path=f"{_RT}/perturb/config.py",
        old="REAL_KV_UNUSED_CACHE in active and sweep_interval <= 0:",
        new="REAL_KV_UNUSED_CACHE in active and sweep_interval < 0:",
        selection=f"{_T}/test_perturb_oracle.py::test_bad_perturb_or_oracle_settings_are_refused",
        speed="quick",
        what="the unused-cache fault is accepted with the sweep off",
    ),
    # ---- request ids, abort mode, metrics ----------------------------------------------------
    Mutant(
        id="i21-rids-not-printed",
        path=f"{_RT}/runner/violation_line.py",
        old='f"rids={format_rids(inc.rids)}"',
        new='"rids=-"',
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_violation_line_names_requests_and_round_trips_odd_ids",
        speed="quick",
        what="the structured line never names the requests",
    ),
    Mutant(
        id="i21-rids-not-resolved",
        path=f"{_RT}/runner/manager.py",
        old="incidents = [dataclasses.replace(inc, rids=t.rids) for inc, t in zip(incidents, touched)]",
        new="incidents = list(incidents)",
        selection=f"{_T}/test_containment.py::test_reports_name_the_requests_in_log_mode",
        speed="quick",
        what="the runner reports incidents without their requests",
    ),
    Mutant(
        id="i21-reader-from-live-rows-only",
        path=f"{_RT}/runner/requests.py",
        old="reqs += [r for r, snap in zip(forward.reqs, forward.rows) if snap == row]",
        new="pass",
        selection=f"{_T}/test_containment.py::"
        "test_resolver_names_a_reader_that_finished_and_ignores_stale_row_entries",
        speed="quick",
        what="a reader that finished before its report is not named",
    ),
    Mutant(
        id="i21-stale-row-entries-match",
        path=f"{_RT}/runner/requests.py",
        old="hits.append(((slots == slot) & live).any(dim=1))",
        new="hits.append((slots == slot).any(dim=1))",
        selection=f"{_T}/test_containment.py::"
        "test_resolver_names_a_reader_that_finished_and_ignores_stale_row_entries",
        speed="quick",
        what="a row's leftover entries past its allocated length match",
    ),
    Mutant(
        id="i21-abort-not-applied",
        path=f"{_RT}/runner/containment.py",
        old="if seam.abort_running_req(req, message):",
        new="if False:",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_aborts_the_touched_requests_evicts_the_prefix_and_keeps_serving",
        speed="quick",
        what="abort mode logs but aborts nothing",
    ),
    Mutant(
        id="i21-no-eviction",
        path=f"{_RT}/runner/containment.py",
        old="freed = seam.radix_evict_subtree(self.radix_cache, node)",
        new="freed = 0",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_aborts_the_touched_requests_evicts_the_prefix_and_keeps_serving",
        speed="quick",
        what="the corrupt prefix stays in the radix cache",
    ),
    Mutant(
        id="i21-lockers-not-aborted",
        path=f"{_RT}/runner/containment.py",
        old="for req in self.resolver.running_mapping_full_slots(slots):",
        new="for req in []:",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_waits_for_locked_nodes_and_aborts_who_locks_them",
        speed="quick",
        what="a request locking a corrupt prefix keeps reading it",
    ),
    Mutant(
        id="i21-prefix-aborts-unlogged",
        path=f"{_RT}/runner/containment.py",
        old="            if rids:\n",
        new="            if False:\n",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_waits_for_locked_nodes_and_aborts_who_locks_them",
        speed="quick",
        what="requests aborted for a corrupt prefix are named nowhere",
    ),
    Mutant(
        id="i21-dropped-not-counted",
        path=f"{_RT}/runner/metrics.py",
        old="self._dropped.inc(dropped)",
        new="pass",
        selection=f"{_T}/test_containment.py::test_metrics_count_dropped_rows",
        speed="quick",
        what="ring overflow never reaches Prometheus",
    ),
    Mutant(
        id="i21-abort-on-tp",
        path=f"{_RT}/api.py",
        old="    if multi:\n",
        new="    if False:\n",
        selection=f"{_T}/test_config.py::test_abort_mode_refuses_what_it_cannot_abort_soundly",
        speed="quick",
        what="abort mode starts on several ranks",
    ),
    Mutant(
        id="i21-max-faults-ignored",
        path=f"{_RT}/perturb/perturber.py",
        old="if self.config.max_faults and len(self.injected) >= self.config.max_faults:",
        new="if False:",
        selection=f"{_T}/test_containment.py::test_max_faults_stops_injection",
        speed="quick",
        what="SGLANG_KV_CANARY_PERTURB_MAX_FAULTS is ignored",
    ),
    # ---- MLA, NSA and hybrid linear-attention pools ------------------------------------------
    Mutant(
        id="i19-nsa-index-keys-unguarded",
        path=f"{_RT}/pool_patcher/adapters/mla.py",
        old="sources.append(nsa_index_key_source(kv_pool))",
        new="pass",
        selection=f"{_T}/test_mla_pool.py::test_nsa_indexer_key_byte_flip_is_caught",
        speed="quick",
        what="NSA indexer keys are not fingerprinted",
    ),
    Mutant(
        id="i19-mla-splice-misses-tail",
        path=f"{_RT}/pool_patcher/adapters/mla.py",
        old='num_k_entries=lambda infos: len(infos[0]),',
        new='num_k_entries=lambda infos: 0,',
        selection=f"{_T}/test_mla_pool.py::test_attach_mla_one_full_k_group_over_the_latent_rows",
        speed="quick",
        what="PD buf infos put the MLA canary rows on the wrong side",
    ),
    Mutant(
        id="i19-mamba-lock-ignored",
        path=f"{_RT}/sglang_seam.py",
        old="return (ref if ref is not None else node.full_lock_ref) > 0",
        new="return (ref or 0) > 0",
        selection=f"{_T}/test_radix_sweep.py::test_walk_real_mamba_radix_cache",
        speed="quick",
        what="the sweep treats locked MambaRadixCache nodes as idle",
    ),
    # ---- per-layer (deep) fingerprints -------------------------------------------------------
    Mutant(
        id="i24-deep-verify-never-reports",
        path=f"{_KN}/deep.py",
        old="bad = live & (stored != fp)",
        new="bad = live & (stored != stored)",
        selection=f"{_T}/test_deep_fingerprints.py::test_flip_is_reported_by_its_column",
        speed="quick",
        what="the per-layer check never reports a mismatch (Triton kernel)",
    ),
    Mutant(
        id="i24-cursor-stuck",
        path=f"{_KN}/deep.py",
        old="        table.cursor.add_(table.columns_per_forward)",
        new="        pass",
        selection=f"{_T}/test_deep_fingerprints.py::"
        "test_rotation_covers_every_column_within_the_bound",
        speed="quick",
        what="the rotating window never moves past layer 0",
    ),
    Mutant(
        id="i24-ref-wrong-half-tag",
        path=f"{_KN}/deep_ref.py",
        old="tag = tag_v if column.half == KvHalf.V else tag_k",
        new="tag = tag_k",
        selection=f"{_T}/test_deep_fingerprints.py::test_flip_is_reported_by_its_column",
        speed="quick",
        what="the reference reports a V flip with the K tag",
    ),
    Mutant(
        id="i24-no-deep-writes",
        path=f"{_RT}/single_forward_manager/manager.py",
        old="        launch_deep_writes(self.plans, inputs.out_cache_loc)\n",
        new="",
        selection=f"{_T}/test_deep_fingerprints.py::test_serving_loop_with_every_layer_is_clean",
        speed="quick",
        what="forwards never fill the per-layer table",
    ),
    Mutant(
        id="i24-no-deep-verify",
        path=f"{_RT}/single_forward_manager/manager.py",
        old="        launch_deep_verifies(self.endpoints, CanaryPhase.TAIL, plans_by_group=self.plans)\n",
        new="",
        selection=f"{_T}/test_deep_fingerprints.py::"
        "test_flip_in_the_last_layer_is_caught_within_the_bound",
        speed="quick",
        what="forwards never check the per-layer table",
    ),
    Mutant(
        id="i24-sweep-skips-layers",
        path=f"{_RT}/runner/sweep.py",
        old="                launch_deep_verify(ep, self.plan, rotate=False)  # every layer, if on\n",
        new="",
        selection=f"{_T}/test_e2e_deep_server.py::"
        "test_last_layer_v_flips_are_caught_with_every_layer",
        speed="slow",
        what="the sweep leaves the per-layer table unchecked",
    ),
    Mutant(
        id="i24-hybrid-local-layer-ids",
        path=f"{_RT}/pool_patcher/adapters/hybrid_linear.py",
        old='layer_ids=[gid for gid, _ in sorted(mapping.items(),',
        new='layer_ids=None and [gid for gid, _ in sorted(mapping.items(),',
        selection=f"{_T}/test_deep_fingerprints.py::"
        "test_flip_in_the_last_layer_is_caught_within_the_bound",
        speed="quick",
        what="reports name the inner pool's index, not the model's layer",
    ),
    Mutant(
        id="i24-target-ignored",
        path=f"{_RT}/perturb/perturber.py",
        old="        if cfg.targets_layer_0_k:",
        new="        if True:",
        selection=f"{_T}/test_deep_fingerprints.py::test_perturbation_flips_the_targeted_row",
        speed="quick",
        what="SGLANG_KV_CANARY_PERTURB_TARGET_LAYER / _HALF are ignored",
    ),
    Mutant(
        id="i24-table-not-spliced",
        path=f"{_RT}/pool_patcher/adapters/mha.py",
        old='k_extra=group.deep.table if group.deep is not None else None,',
        new='k_extra=None,',
        selection=f"{_T}/test_deep_fingerprints.py::test_the_table_is_spliced_after_the_k_tail",
        speed="quick",
        what="PD transfers leave the per-layer table behind",
    ),
    Mutant(
        id="i24-all-without-real-data",
        path=f"{_RT}/config.py",
        old='            and self.real_kv_hash_mode == RealKvHashMode.NONE\n',
        new='            and False\n',
        selection=f"{_T}/test_config.py::test_startup_refusals_name_the_flag",
        speed="quick",
        what="--kv-canary-real-data-layers all starts with real data off",
    ),
    # ---- multi-GPU deployments ---------------------------------------------------------------
    Mutant(
        id="i20-rank-target-ignored",
        path=f"{_RT}/perturb/config.py",
        old='            and all(\n                getattr(self, field) in (None, ranks.rank(dim))',
        new='            or all(\n                getattr(self, field) in (None, ranks.rank(dim))',
        selection=f"{_T}/test_config.py::"
        "test_rank_targets_parse_match_and_are_checked_against_the_server",
        speed="quick",
        what="SGLANG_KV_CANARY_PERTURB_TP_RANK injects on every rank",
    ),
    Mutant(
        id="i20-rank-not-checked",
        path=f"{_RT}/api.py",
        old='    config.perturb.check_ranks(\n',
        new='    (lambda _: None)(\n',
        selection=f"{_T}/test_config.py::"
        "test_rank_targets_parse_match_and_are_checked_against_the_server",
        speed="quick",
        what="a rank target beyond --tp-size starts",
    ),
    Mutant(
        id="i20-runner-ranks-dropped",
        path=f"{_RT}/runner/manager.py",
        old="        if config.perturb.injects_on(ranks):",
        new="        if config.perturb.injects_on(RankFacts()):",
        selection=f"{_T}/test_e2e_tp_server.py::"
        "test_a_fault_on_one_rank_is_reported_by_that_rank_only_and_raise_stops_the_server",
        speed="slow",
        what="every rank believes it is rank 0 (faults land on the wrong rank)",
    ),
    # ---- HiCache -----------------------------------------------------------------------------
    Mutant(
        id="i23-load-not-mirrored",
        path=f"{_RT}/runner/hicache.py",
        old='src=host, dst=rows, src_indices=host_indices,',
        new='src=host, dst=host, src_indices=host_indices,',
        selection=f"{_T}/test_deep_fingerprints.py::test_host_tier_mirror_on_real_pools",
        speed="quick",
        what="loaded-back slots keep stale canary rows",
    ),
    Mutant(
        id="i23-backup-not-mirrored",
        path=f"{_RT}/runner/hicache.py",
        old='src=rows, dst=host, src_indices=device_indices,',
        new='src=rows, dst=rows, src_indices=device_indices,',
        selection=f"{_T}/test_deep_fingerprints.py::test_host_tier_mirror_on_real_pools",
        speed="quick",
        what="backups leave the canary rows on the device",
    ),
    Mutant(
        id="i23-host-kv-anywhere",
        path=f"{_RT}/perturb/perturber.py",
        old="        if not host_only:\n            return\n",
        new="        if True:\n            return\n",
        selection=f"{_T}/test_e2e_hicache_server.py::"
        "test_a_flipped_host_byte_is_found_in_host_memory_and_when_loaded_back",
        speed="slow",
        what="the host_kv fault never flips a host byte",
    ),
    Mutant(
        id="i23-host-kv-without-hicache",
        path=f"{_RT}/api.py",
        old='and not value(\n        server_args, "enable_hierarchical_cache", False\n    ):',
        new='and False:',
        selection=f"{_T}/test_config.py::test_host_kv_needs_hicache",
        speed="quick",
        what="host_kv starts without a host tier",
    ),
    Mutant(
        id="i23-demo-host-kv-without-hicache",
        path=f"{_RT}/demo.py",
        old='        args["enable_hierarchical_cache"] = True\n',
        new="        pass\n",
        selection=f"{_T}/test_perturb_oracle.py::test_demo_refuses_paged_runs_without_a_gpu",
        speed="quick",
        what="the demo's host_kv server runs without HiCache",
    ),
    # ---- trees the sweep walks ----------------------------------------------------------------
    Mutant(
        id="sweep-unified-tree-unsupported",
        path=f"{_RT}/sglang_seam.py",
        old="    return (RadixCache, SWARadixCache, MambaRadixCache, UnifiedRadixCache)",
        new="    return (RadixCache, SWARadixCache, MambaRadixCache)",
        selection=f"{_T}/test_radix_sweep.py::test_walk_real_unified_radix_cache",
        speed="quick",
        what="the sweep cannot walk the unified radix tree",
    ),
    Mutant(
        id="sweep-unified-locks-ignored",
        path=f"{_RT}/sglang_seam.py",
        old="        return full.lock_ref > 0\n",
        new="        return False\n",
        selection=f"{_T}/test_radix_sweep.py::test_walk_real_unified_radix_cache",
        speed="quick",
        what="unified-tree nodes held by running requests count as idle",
    ),
    Mutant(
        id="sweep-chunk-cache-walked",
        path=f"{_RT}/runner/sweep.py",
        old="        if seam.is_chunk_cache(radix_cache):",
        new="        if False:",
        selection=f"{_T}/test_radix_sweep.py::"
        "test_orchestrator_without_a_radix_cache_and_with_a_tree_it_cannot_walk",
        speed="quick",
        what="--disable-radix-cache with the sweep on stops the server",
    ),
    # ---- speculative decoding ----------------------------------------------------------------
    *_SPEC_MODE_SKIPS,
    Mutant(
        id="spec-draft-token-offset-0",
        path=f"{_RT}/api.py",
        old="kv_token_id_vs_position_offset=1 if draft else 0,",
        new="kv_token_id_vs_position_offset=0,",
        selection=f"{_T}/test_speculative.py::test_install_canary_guards_the_draft_runner",
        speed="quick",
        what="the draft pool compares position p with token p, not p + 1",
    ),
    Mutant(
        id="spec-draft-forwards-share-sfm-0",
        path=f"{_RT}/runner/manager.py",
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
        path=f"{_RT}/single_forward_manager/manager.py",
        old="        if out_cache_loc.is_contiguous():\n",
        new="        if True:\n",
        selection=f"{_T}/test_speculative.py::test_eagle_rounds_run_clean_with_token_checks",
        speed="quick",
        what="a draft forward's strided slots reach the write launches",
    ),
    Mutant(
        id="spec-v1-draft-extend-keeps-finished-reqs",
        path=f"{_RT}/sglang_seam.py",
        old="        reqs = [r for r in reqs if not r.finished()]\n",
        new="        pass\n",
        selection=f"{_T}/test_plugin_hooks.py::"
        "test_spec_v1_draft_extend_snapshots_only_the_unfinished_requests",
        speed="quick",
        what="spec v1's draft extend snapshots the round's finished requests",
    ),
    Mutant(
        id="raise-message-without-rank",
        path=f"{_RT}/runner/manager.py",
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
        path=f"{_RT}/runner/manager.py",
        old='                pool=DRAFT_POOL_LABEL if ranks.draft else "",\n',
        new='                pool="",\n',
        selection=f"{_T}/test_speculative.py::test_a_flipped_byte_is_caught_by_its_pool_canary",
        speed="quick",
        what="a draft-pool report does not say it is the draft pool",
    ),
    Mutant(
        id="piecewise-replay-reads-padded-batch",
        path=f"{_RT}/single_forward_manager/manager.py",
        old="        if self._capturing:\n            return forward_batch\n",
        new="        if True:\n            return forward_batch\n",
        selection=f"{_T}/test_piecewise.py::"
        "test_a_padded_piecewise_replay_is_checked_as_the_scheduler_sent_it",
        speed="quick",
        what="a piecewise replay's inside ops read sglang's padded copy",
    ),
    Mutant(
        id="piecewise-set-up-runs-the-canary",
        path=f"{_RT}/runner/manager.py",
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
        path=f"{_RT}/single_forward_manager/manager.py",
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
        path=f"{_RT}/runner/manager.py",
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
        old='            dst.append(self.req_pool_indices[bs : self._rows_filled])\n            src.append(self._zeros[: self._rows_filled - bs])\n',
        new='            pass\n',
        selection=f"{_T}/test_eager_graphs.py::"
        "test_fill_padded_zeroes_only_the_rows_a_larger_batch_left "
        f"{_T}/test_eager_graphs.py::"
        "test_static_padded_inputs_leave_the_same_records_as_the_batch_tensors",
        speed="quick",
        what="static eager launches re-plan the rows of a larger earlier batch",
    ),
    Mutant(
        id="eager-graphs-stale-slots-kept",
        path=f"{_RT}/single_forward_manager/eager_graphs.py",
        old='            dst.append(self.out_cache_loc[n : self._tokens_filled])\n            src.append(self._zeros[: self._tokens_filled - n])\n',
        new='            pass\n',
        selection=f"{_T}/test_eager_graphs.py::"
        "test_a_smaller_batch_pads_the_rows_and_slots_a_larger_one_left",
        speed="quick",
        what="static eager slots past the forward keep an earlier forward's",
    ),
    Mutant(
        id="eager-graphs-positions-unstaged",
        path=f"{_RT}/single_forward_manager/eager_graphs.py",
        old="leading(forward_batch.positions, n),\n",
        new="self.positions[:n],\n",
        selection=f"{_T}/test_eager_graphs.py::"
        "test_static_padded_inputs_leave_the_same_records_as_the_batch_tensors",
        speed="quick",
        what="static eager launches read stale positions",
    ),
    Mutant(
        id="eager-graphs-token-scatter-left-out",
        path=f"{_RT}/single_forward_manager/manager.py",
        old='            self.token_history.launch_replay_scatter(rpi, self.expected_valid_lens[: rpi.shape[0]])\n',
        new='            pass\n',
        selection=f"{_T}/test_eager_graphs.py::"
        "test_static_padded_inputs_leave_the_same_records_as_the_batch_tensors",
        speed="quick",
        what="an eager forward's graph does not scatter the staged token history",
    ),
    Mutant(
        id="copy-pairs-drops-conversions",
        path=f"{_RT}/plan_input.py",
        old="    if conv_d:\n        torch._foreach_copy_(conv_d, conv_s)\n",
        new="",
        selection=f"{_T}/test_eager_graphs.py::"
        "test_plan_input_normalises_each_mode_from_sglang_dtypes",
        speed="quick",
        what="the staging copies skip sglang's int32 lengths",
    ),
    # ---- session 8: packed read-back, packed token upload -------------------------------------
    Mutant(
        id="readback-one-buffer",
        path=f"{_RT}/runner/device_host.py",
        old="        self._flip ^= 1\n",
        new="",
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_device_host_handler_packs_mixed_dtypes_into_one_buffer",
        speed="quick",
        what="a stage overwrites the read-back the consumer has not read yet",
    ),
    Mutant(
        id="readback-unaligned-layout",
        path=f"{_RT}/runner/device_host.py",
        old="    order = sorted(range(len(leaves)), key=lambda i: -leaves[i].element_size())\n",
        new="    order = list(range(len(leaves)))\n",
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_device_host_handler_packs_mixed_dtypes_into_one_buffer",
        speed="quick",
        what="packed read-back places an int64 tensor after an int32 one",
    ),
    Mutant(
        id="replay-scatter-not-captured",
        path=f"{_RT}/single_forward_manager/manager.py",
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
        old="            mismatched += 1\n",
        new="            pass\n",
        selection=f"{_T}/test_bench_interleaved.py::"
        "test_measure_sends_each_round_to_every_server_in_rotating_order",
        speed="quick",
        what="a config that changes greedy outputs goes unnoticed",
    ),
    Mutant(
        id="guard-ignores-holders",
        path=f"{_RT}/runner/ownership.py",
        old="        ok = ~was_free & (~other | (fits & ~has_orphan))\n",
        new="        ok = ~was_free\n",
        selection=f"{_T}/test_release_guard.py::test_a_page_the_radix_cache_holds_is_held_back",
        speed="quick",
        what="an aborted request frees a page another holder names",
    ),
    Mutant(
        id="guard-holds-back-its-own",
        path=f"{_RT}/runner/ownership.py",
        old="        ok = ~was_free & (~other | (fits & ~has_orphan))\n",
        new="        ok = ~was_free & ~other\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_an_aborted_request_frees_its_own_slots_not_the_ones_its_corrupt_row_names",
        speed="quick",
        what="a request holds back its own slot another's corrupt row names "
        "(sglang's busy check sees a leak)",
    ),
    Mutant(
        id="guard-trusts-identical-records",
        path=f"{_RT}/runner/ownership.py",
        old="        ok = ~was_free & (~other | (fits & ~has_orphan))\n",
        new="        ok = ~was_free & (~other | fits)\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_identical_prefixes_make_the_other_holders_slot_look_like_the_requests_own",
        speed="quick",
        what="an identical record makes another holder's slot the request's",
    ),
    Mutant(
        id="guard-page-mates-unattributed",
        path=f"{_RT}/runner/ownership.py",
        old="            unattributed = int((lost & ~torch.isin(keys, rec_keys[mine])).sum())\n",
        new="            unattributed = int(lost.sum())\n",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_corrupt_entry_whose_page_mates_free_its_own_page_is_attributed",
        speed="quick",
        what="a slot freed with its page mates is reported unattributed",
    ),
    Mutant(
        id="guard-no-reclaim",
        path=f"{_RT}/runner/ownership.py",
        old="        if plan.reclaim.numel():\n",
        new="        if False:\n",
        selection=f"{_T}/test_release_guard.py::test_a_row_naming_its_own_slot_twice_frees_it_once",
        speed="quick",
        what="the slot a corrupt row lost stays allocated",
    ),
    Mutant(
        id="guard-no-dedupe",
        path=f"{_RT}/runner/ownership.py",
        old="            if page_size == 1:\n                idx = torch.unique(idx)\n",
        new="",
        selection=f"{_T}/test_release_guard.py::test_a_row_naming_its_own_slot_twice_frees_it_once",
        speed="quick",
        what="a slot a row names twice is freed twice",
    ),
    Mutant(
        id="guard-settle-frees-nothing",
        path=f"{_RT}/runner/ownership.py",
        old="            orphans = orphan.tolist()\n",
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
        path=f"{_RT}/runner/containment.py",
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
        id="guard-nests",
        path=f"{_RT}/runner/ownership.py",
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
        path=f"{_RT}/runner/manager.py",
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
        path=f"{_RT}/runner/manager.py",
        old="            self.metrics.set_memory(self.memory, draft=self.ranks.draft)\n",
        new="            pass\n",
        selection=f"{_T}/test_memory.py::test_the_gauge_exports_the_bytes_by_part",
        speed="quick",
        what="sglang:kv_canary_memory_bytes is never set",
    ),
    Mutant(
        id="memory-host-pool-unshrunk",
        path=f"{_RT}/api.py",
        old="    share = kv / (kv + mirror)\n",
        new="    share = 1.0\n",
        selection=f"{_T}/test_deep_fingerprints.py::test_host_tier_mirror_on_real_pools",
        speed="quick",
        what="HiCache's host pool keeps its KV budget (the mirror comes on top)",
    ),
)
