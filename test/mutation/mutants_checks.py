"""Planted defects, first part: the checks themselves (chain, plan, verify, write, the
references, the runtime's read-back and reporting, configuration), abort mode's reader, and the
coverage of pool families, ranks and the host tier. Joined with ``mutants_paths.py`` in
``mutants.py``."""

from __future__ import annotations

from mutant_types import _KN, _RT, _T, Mutant

MUTANTS_CHECKS = (
    # ---- the audit's rows --------------------------------------------------------------------
    Mutant(
        id="row1-sweep-swa-untranslated",
        path=f"{_RT}/manager/sweep.py",
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
        old="self.set_chain_position_assert(True)",
        new="self.set_chain_position_assert(False)",
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
        path=f"{_RT}/manager/overflow.py",
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
        path=f"{_RT}/single_forward_manager/forward_manager.py",
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
        id="pd-faked-transfer-any-request",
        path=f"{_RT}/violations/resolver.py",
        old="faked_transfer=bool(ordered) and all(map(self.faked_transfer, ordered)),",
        new="faked_transfer=bool(ordered) and any(map(self.faked_transfer, ordered)),",
        selection=f"{_T}/test_containment.py::"
        "test_resolver_marks_incidents_that_touch_only_faked_transfers",
        speed="quick",
        what="a slot a faked PD transfer shares with a real one is set aside, not reported",
    ),
    Mutant(
        id="kernel-write-failed-steps-unreported",
        path=f"{_KN}/_chain_triton.py",
        old="if tl.max(bad.to(tl.int32), axis=0) != 0:",
        new="if tl.max(bad.to(tl.int32), axis=0) > 1:",
        selection=f"{_T}/test_kernels_hand_writes.py::"
        "test_write_over_its_own_seed_reports_the_hash_it_walked[triton]",
        speed="quick",
        what="the chain write stores its records but appends no failed step's row",
    ),
    Mutant(
        id="kernel-write-report-hash-after-the-step",
        path=f"{_KN}/_chain_triton.py",
        old="            H.as_i64(prev),\n            tl.where(chain_bad, expected_pos, exp_pos),",
        new="            H.as_i64(after),\n            tl.where(chain_bad, expected_pos, exp_pos),",
        selection=f"{_T}/test_kernels_hand_writes.py::"
        "test_write_over_its_own_seed_reports_the_hash_it_walked[triton]",
        speed="quick",
        what="a failed step's ring row carries the chain state after the step, not its record's",
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
        path=f"{_RT}/violations/records.py",
        old="entry[1] |= rec.fail_bits",
        new="entry[1] = rec.fail_bits",
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_an_incident_unites_the_reasons_of_all_its_rows",
        speed="quick",
        what="merged incident keeps the last row's reasons only",
    ),
    Mutant(
        id="rt-ring-not-emptied",
        path=f"{_RT}/manager/canary_manager.py",
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
        path=f"{_RT}/violations/lines.py",
        old='f"rids={format_rids(inc.rids)}"',
        new='"rids=-"',
        selection=f"{_T}/test_runtime_reporting.py::"
        "test_violation_line_names_requests_and_round_trips_odd_ids",
        speed="quick",
        what="the structured line never names the requests",
    ),
    Mutant(
        id="i21-rids-not-resolved",
        path=f"{_RT}/manager/reporting.py",
        old="incidents = [dataclasses.replace(inc, rids=t.rids) for inc, t in zip(incidents, touched)]",
        new="incidents = list(incidents)",
        selection=f"{_T}/test_containment.py::test_reports_name_the_requests_in_log_mode",
        speed="quick",
        what="the runner reports incidents without their requests",
    ),
    Mutant(
        id="i21-reader-from-live-rows-only",
        path=f"{_RT}/violations/resolver.py",
        old="reqs += [r for r, snap in zip(forward.reqs, forward.rows) if snap == row]",
        new="pass",
        selection=f"{_T}/test_containment.py::"
        "test_resolver_names_a_reader_that_finished_and_ignores_stale_row_entries",
        speed="quick",
        what="a reader that finished before its report is not named",
    ),
    Mutant(
        id="i21-stale-row-entries-match",
        path=f"{_RT}/violations/resolver.py",
        old="hits.append(((slots == slot) & live).any(dim=1))",
        new="hits.append((slots == slot).any(dim=1))",
        selection=f"{_T}/test_containment.py::"
        "test_resolver_names_a_reader_that_finished_and_ignores_stale_row_entries",
        speed="quick",
        what="a row's leftover entries past its allocated length match",
    ),
    Mutant(
        id="i21-abort-not-applied",
        path=f"{_RT}/violations/containment.py",
        old="if seam.abort_running_req(req, message):",
        new="if False:",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_aborts_the_touched_requests_evicts_the_prefix_and_keeps_serving",
        speed="quick",
        what="abort mode logs but aborts nothing",
    ),
    Mutant(
        id="i21-no-eviction",
        path=f"{_RT}/violations/containment.py",
        old="freed = seam.radix_evict_subtree(self.radix_cache, node)",
        new="freed = 0",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_aborts_the_touched_requests_evicts_the_prefix_and_keeps_serving",
        speed="quick",
        what="the corrupt prefix stays in the radix cache",
    ),
    Mutant(
        id="i21-lockers-not-aborted",
        path=f"{_RT}/violations/containment.py",
        old="for req in (r for r, h in zip(reqs, hit) if h):",
        new="for req in []:",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_waits_for_locked_nodes_and_aborts_who_locks_them",
        speed="quick",
        what="a request locking a corrupt prefix keeps reading it",
    ),
    Mutant(
        id="i21-prefix-aborts-unlogged",
        path=f"{_RT}/violations/containment.py",
        old="            if rids:\n",
        new="            if False:\n",
        selection=f"{_T}/test_containment.py::"
        "test_abort_mode_waits_for_locked_nodes_and_aborts_who_locks_them",
        speed="quick",
        what="requests aborted for a corrupt prefix are named nowhere",
    ),
    Mutant(
        id="i21-dropped-not-counted",
        path=f"{_RT}/violations/metrics.py",
        old="self._dropped.inc(dropped)",
        new="pass",
        selection=f"{_T}/test_containment.py::test_metrics_count_dropped_rows",
        speed="quick",
        what="ring overflow never reaches Prometheus",
    ),
    Mutant(
        id="i21-abort-on-tp",
        path=f"{_RT}/startup_checks.py",
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
        path=f"{_RT}/sglang_seam/radix.py",
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
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="        launch_deep_writes(self.plans, inputs.out_cache_loc)\n",
        new="",
        selection=f"{_T}/test_deep_fingerprints.py::test_serving_loop_with_every_layer_is_clean",
        speed="quick",
        what="forwards never fill the per-layer table",
    ),
    Mutant(
        id="i24-no-deep-verify",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="        launch_deep_verifies(self.endpoints, CanaryPhase.TAIL, plans_by_group=self.plans)\n",
        new="",
        selection=f"{_T}/test_deep_fingerprints.py::"
        "test_flip_in_the_last_layer_is_caught_within_the_bound",
        speed="quick",
        what="forwards never check the per-layer table",
    ),
    Mutant(
        id="i24-sweep-skips-layers",
        path=f"{_RT}/manager/sweep.py",
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
        path=f"{_RT}/startup_checks.py",
        old='    config.perturb.check_ranks(\n',
        new='    (lambda _: None)(\n',
        selection=f"{_T}/test_config.py::"
        "test_rank_targets_parse_match_and_are_checked_against_the_server",
        speed="quick",
        what="a rank target beyond --tp-size starts",
    ),
    Mutant(
        id="i20-runner-ranks-dropped",
        path=f"{_RT}/manager/canary_manager.py",
        old="        if config.perturb.injects_on(ranks):",
        new="        if config.perturb.injects_on(RankFacts()):",
        selection=f"{_T}/test_e2e_tp_server.py::"
        "test_tp2_clean_matches_canary_off_then_a_fault_on_rank_1_stops_the_server",
        speed="slow",
        what="every rank believes it is rank 0 (faults land on the wrong rank)",
    ),
    # ---- HiCache -----------------------------------------------------------------------------
    Mutant(
        id="i23-load-not-mirrored",
        path=f"{_RT}/manager/hicache.py",
        old='src=host, dst=rows, src_indices=host_indices,',
        new='src=host, dst=host, src_indices=host_indices,',
        selection=f"{_T}/test_deep_fingerprints.py::test_host_tier_mirror_on_real_pools",
        speed="quick",
        what="loaded-back slots keep stale canary rows",
    ),
    Mutant(
        id="i23-backup-not-mirrored",
        path=f"{_RT}/manager/hicache.py",
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
        path=f"{_RT}/startup_checks.py",
        old='and not value(\n        server_args, "enable_hierarchical_cache", False\n    ):',
        new='and False:',
        selection=f"{_T}/test_config.py::test_host_kv_needs_hicache",
        speed="quick",
        what="host_kv starts without a host tier",
    ),
    Mutant(
        id="i23-demo-host-kv-without-hicache",
        path=f"{_RT}/demo/cases.py",
        old='        args["enable_hierarchical_cache"] = True\n',
        new="        pass\n",
        selection=f"{_T}/test_perturb_oracle.py::test_demo_refuses_paged_runs_without_a_gpu",
        speed="quick",
        what="the demo's host_kv server runs without HiCache",
    ),
    # ---- trees the sweep walks ----------------------------------------------------------------
    Mutant(
        id="sweep-unified-tree-unsupported",
        path=f"{_RT}/sglang_seam/radix.py",
        old="    return (RadixCache, SWARadixCache, MambaRadixCache, UnifiedRadixCache)",
        new="    return (RadixCache, SWARadixCache, MambaRadixCache)",
        selection=f"{_T}/test_radix_sweep.py::test_walk_real_unified_radix_cache",
        speed="quick",
        what="the sweep cannot walk the unified radix tree",
    ),
    Mutant(
        id="sweep-unified-locks-ignored",
        path=f"{_RT}/sglang_seam/radix.py",
        old="        return full.lock_ref > 0\n",
        new="        return False\n",
        selection=f"{_T}/test_radix_sweep.py::test_walk_real_unified_radix_cache",
        speed="quick",
        what="unified-tree nodes held by running requests count as idle",
    ),
    Mutant(
        id="sweep-chunk-cache-walked",
        path=f"{_RT}/manager/sweep.py",
        old="        if seam.is_chunk_cache(radix_cache):",
        new="        if False:",
        selection=f"{_T}/test_radix_sweep.py::"
        "test_orchestrator_without_a_radix_cache_and_with_a_tree_it_cannot_walk",
        speed="quick",
        what="--disable-radix-cache with the sweep on stops the server",
    ),
    Mutant(
        id="sweep-interval-no-lower-bound",
        path=f"{_RT}/config.py",
        old="    if n is None or not 0 <= n <= MAX_STEP_INTERVAL:",
        new="    if n is None or not n <= MAX_STEP_INTERVAL:",
        selection=f"{_T}/test_startup.py::"
        "test_the_same_values_are_refused_everywhere_naming_the_flag",
        speed="quick",
        what="a negative integer sweep interval from Engine kwargs is accepted",
    ),
    Mutant(
        id="kept-page-fault-on-seed-page",
        path=f"{_RT}/perturb/perturber.py",
        old="targets = [(r, (n - 1) // ps) for r, n in live if r in rows and (n - 1) // ps > 0]",
        new="targets = [(r, (n - 1) // ps + 1) for r, n in live if r in rows and (n - 1) // ps > 0]",
        selection=f"{_T}/test_perturb_oracle.py::"
        "test_a_kept_fault_never_rewrites_its_requests_seed_page",
        speed="quick",
        what="the kept page fault may rewrite the page the new KV chains from",
    ),
    Mutant(
        id="verify-skips-last-entry",
        path=f"{_KN}/verify.py",
        old="        in_plan = offs < n\n",
        new="        in_plan = offs < n - 1\n",
        selection=f"{_T}/test_kernels_hand.py::"
        "test_a_record_corrupted_at_either_end_of_the_plan_is_reported_there",
        speed="quick",
        what="the verify kernel never reads its plan's last entry",
    ),
    Mutant(
        id="reservation-without-draft-canary",
        path=f"{_RT}/memory_budget.py",
        old="        return sum(m.device_bytes for m in memories if m is not None)",
        new="        return memories[0].device_bytes",
        selection=f"{_T}/test_memory.py::"
        "test_the_budget_holds_the_pool_and_the_target_and_draft_canaries",
        speed="quick",
        what="the KV budget leaves out the speculative draft's canary",
    ),
    Mutant(
        id="guard-reclaims-a-named-slot",
        path=f"{_RT}/violations/release_guard.py",
        old="            orphan = ~named[cand] & ~free[cand] & ~torch.isin(cand, pages)",
        new="            orphan = ~free[cand] & ~torch.isin(cand, pages)",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_third_holder_of_identical_records_keeps_its_page",
        speed="quick",
        what="the release guard reclaims a slot a third live holder of the same record names",
    ),
    Mutant(
        id="guard-ignores-own-page-mates",
        path=f"{_RT}/violations/release_guard.py",
        old="            mine = slots[orphan | torch.isin(cand, own_pages)]",
        new="            mine = slots[orphan]",
        selection=f"{_T}/test_release_guard.py::"
        "test_a_third_holder_of_identical_records_keeps_its_page",
        speed="quick",
        what="at page size > 1 a release frees another's page whose record fits its own",
    ),
    Mutant(
        id="guard-same-record-by-chance",
        path=f"{_RT}/violations/release_guard.py",
        old="            has_orphan[:n] = same.any(dim=1) & doubt & fits[:n]",
        new="            has_orphan[:n] = torch.isin(keys, rec_keys[mine]) & doubt",
        selection=f"{_T}/test_release_guard.py::"
        "test_an_evicted_prefix_frees_the_page_a_corrupt_row_names_and_keeps_sglangs_count",
        speed="quick",
        what="a slot with the same (position, token) by chance counts as the same record: an "
        "eviction holds back a page sglang counts nowhere",
    ),
    # ---- speculative decoding ----------------------------------------------------------------
    Mutant(
        id="draft-violations-acted-on",
        path=f"{_RT}/config.py",
        old="        if draft and self.draft_violations == DraftViolations.REPORT and self.enabled:",
        new="        if False:",
        selection=f"{_T}/test_speculative_draft_reports.py::"
        "test_a_draft_pool_fault_under_raise_is_logged_and_counted_unless_act",
        speed="quick",
        what="raise and abort act on a draft pool's violations by default",
    ),
    Mutant(
        id="tree-write-folds-leaf-first",
        path=f"{_KN}/_tree_triton.py",
        old="                    up = fold & (hop < depth - 1 - level)",
        new="                    up = fold & (hop < level)",
        selection=f"{_T}/test_kernels_tree_write.py::"
        "test_each_node_is_chained_from_its_path_root_first",
        speed="quick",
        what="a draft tree's node records fold their path leaf first, not root first",
    ),
    Mutant(
        id="draft-lanes-planned-as-one-chain",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="                lanes=inputs.lanes,",
        new="                lanes=None,",
        selection=f"{_T}/test_speculative_trees.py::test_a_lane_is_verified_from_its_own_columns",
        speed="quick",
        what="a draft round's later lanes are verified at the first lane's columns",
    ),
    Mutant(
        id="verify-tree-written-as-a-chain",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="            tree=self.tree if self._is_tree_forward(forward_batch) else None,",
        new="            tree=None,",
        selection=f"{_T}/test_speculative_trees.py::test_tree_rounds_run_clean_with_token_checks",
        speed="quick",
        what="a target verify's tree nodes are chained in entry order, not along their paths",
    ),
    Mutant(
        id="ngram-verify-sized-as-an-eagle-chain",
        path=f"{_RT}/sglang_seam/server_args.py",
        old="            return self.num_draft_tokens\n",
        new="            return self.max_steps + 1 if self.topk > 1 else 0\n",
        selection=f"{_T}/test_speculative_install.py::test_an_ngram_server_guards_its_target_verify_trees",
        speed="quick",
        what="NGRAM's verify trees bounded by EAGLE's step count, not its draft tokens",
    ),
    Mutant(
        id="ngram-target-found-as-its-draft-runner",
        path=f"{_RT}/sglang_seam/scheduler.py",
        old="    return None if runner is target else runner\n",
        new="    return runner\n",
        selection=f"{_T}/test_speculative_install.py::test_an_ngram_scheduler_has_no_draft_runner",
        speed="quick",
        what="an NGRAM worker's runner (the target's) taken for a draft runner",
    ),
    Mutant(
        id="replayed-draft-round-scatters-by-lane-rows",
        path=f"{_RT}/single_forward_manager/forward_manager.py",
        old="                    rpi = forward_batch.req_pool_indices\n",
        new="                    rpi = inputs.req_pool_indices\n",
        selection=(
            f"{_T}/test_speculative_trees.py::"
            "test_replayed_draft_rounds_check_each_lane_against_its_own_request_s_tokens"
        ),
        speed="quick",
        what="a replayed draft round's token scatter by its lanes' rows, not its requests'",
    ),
    Mutant(
        id="gpu-lanes-share-one-port-range",
        path="test/gpu_lanes_run.py",
        old='        KV_CANARY_PORT_SHARE=f"{share[0]}/{share[1]}",\n',
        new="",
        selection=(
            f"{_T}/test_ci_registration.py::"
            "test_each_lane_s_servers_pick_ports_from_a_share_of_their_own"
        ),
        speed="quick",
        what="the GPU suite's lanes pick their servers' ports from one range",
    ),
    Mutant(
        id="frozen-kv-mtp-draft-runner-gets-a-canary",
        path=f"{_RT}/install.py",
        old="    if draft and not spec.has_draft_pool:\n",
        new="    if False:\n",
        selection=(
            f"{_T}/test_speculative_install.py::"
            "test_a_frozen_kv_mtp_server_guards_its_target_pool_and_installs_no_draft_canary"
        ),
        speed="quick",
        what="a FROZEN_KV_MTP draft runner (its pool a stand-in) given a canary",
    ),
    Mutant(
        id="paged-lanes-keep-page-1-shift",
        path=f"{_RT}/plan_input.py",
        old="        if self._lane_page_stride is not None:\n",
        new="        if False:\n",
        selection=(
            f"{_T}/test_speculative_trees.py::test_paged_lane_rows_read_the_columns_sglang_lays_out"
        ),
        speed="quick",
        what="a paged draft round's lanes planned without their page shift and split",
    ),
)
