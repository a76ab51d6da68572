#!/usr/bin/env bash
# The whole GPU suite over the GPUs, as lanes derived from the test files' register_cuda_ci
# declarations (test/gpu_lanes.py; docs/testing.md, "The GPU suite"). On the device machine, from
# the repository root, after the bundles are installed:
#   bash test/gpu_lanes.sh                  # every lane; one line per lane, then all together
#   bash test/gpu_lanes.sh e2e_swa_gpu hicache_mla   # only the lanes named (--list: the names)
# Exit status: 0 when no lane failed (a lane needing more GPUs than there are is skipped, and
# said so). Every cuda-marked test is in exactly one lane. --gpus 0,1 (or a count) picks GPUs.
#
# Lanes (python3 test/gpu_lanes.py --sync-sh writes this list; --check compares it):
#   e2e_abort_gpu        test/registered/kv_canary/test_e2e_abort_gpu.py -k not storm
#   abort_storm_gpu_page_1 test/registered/kv_canary/test_e2e_abort_gpu.py -k storm and one_slot_pages
#   abort_storm_gpu_page_16 test/registered/kv_canary/test_e2e_abort_gpu.py -k storm and sixteen_slot_pages
#   core                 test/registered/kv_canary/test_e2e_gpu.py -k not piecewise and not corrupted and not demo
#   core_fault           test/registered/kv_canary/test_e2e_gpu.py -k corrupted_record
#   piecewise            test/registered/kv_canary/test_e2e_gpu.py -k piecewise
#   demo_raise           test/registered/kv_canary/test_e2e_gpu.py -k demo
#   heal_storm_gpu_page_1 test/registered/kv_canary/test_e2e_heal_gpu.py -k one_slot_pages
#   heal_storm_gpu_page_16 test/registered/kv_canary/test_e2e_heal_gpu.py -k sixteen_slot_pages
#   hicache_kernel       test/registered/kv_canary/test_e2e_hicache_gpu.py -k mha_kernel
#   hicache_page_first   test/registered/kv_canary/test_e2e_hicache_gpu.py -k page_first
#   hicache_direct       test/registered/kv_canary/test_e2e_hicache_gpu.py -k mha_direct
#   hicache_mla          test/registered/kv_canary/test_e2e_hicache_gpu.py -k mla
#   hicache_spec         test/registered/kv_canary/test_e2e_hicache_gpu.py -k with_a_draft_model
#   shape_mla            test/registered/kv_canary/test_e2e_model_shapes_gpu.py -k mla
#   shape_nsa            test/registered/kv_canary/test_e2e_model_shapes_gpu.py -k nsa
#   shape_hybrid         test/registered/kv_canary/test_e2e_model_shapes_gpu.py -k hybrid
#   paged_clean_16       test/registered/kv_canary/test_e2e_paged_gpu.py -k clean and 16
#   paged_clean_64       test/registered/kv_canary/test_e2e_paged_gpu.py -k clean and 64
#   paged_faults_16      test/registered/kv_canary/test_e2e_paged_gpu.py -k log_mode and 16
#   paged_faults_64      test/registered/kv_canary/test_e2e_paged_gpu.py -k log_mode and 64
#   pd_faults_pages      test/registered/kv_canary/test_e2e_pd_faults_gpu.py -k byte_flipped or demo_shows
#   pd_faults_decode     test/registered/kv_canary/test_e2e_pd_faults_gpu.py -k req_to_token or without_the_canary_rows
#   e2e_pd_gpu           test/registered/kv_canary/test_e2e_pd_gpu.py
#   spec_clean_v2        test/registered/kv_canary/test_e2e_speculative_gpu.py -k clean and spec_v2 and not standalone
#   spec_clean_v1        test/registered/kv_canary/test_e2e_speculative_gpu.py -k clean and spec_v1 and not standalone
#   spec_pr25015         test/registered/kv_canary/test_e2e_speculative_gpu.py -k pr25015
#   spec_pr26329         test/registered/kv_canary/test_e2e_speculative_gpu.py -k pr26329
#   spec_pr28254_v2      test/registered/kv_canary/test_e2e_speculative_gpu.py -k pr28254 and spec_v2
#   spec_pr28254_v1      test/registered/kv_canary/test_e2e_speculative_gpu.py -k pr28254 and spec_v1 and chain
#   spec_pr28254_tree    test/registered/kv_canary/test_e2e_speculative_gpu.py -k pr28254 and tree
#   spec_faults_v2       test/registered/kv_canary/test_e2e_speculative_gpu.py -k fault and spec_v2 and not standalone
#   spec_faults_v1       test/registered/kv_canary/test_e2e_speculative_gpu.py -k fault and spec_v1 and not standalone
#   spec_adaptive_v2     test/registered/kv_canary/test_e2e_speculative_gpu.py -k adaptive and spec_v2
#   spec_adaptive_v1     test/registered/kv_canary/test_e2e_speculative_gpu.py -k adaptive and spec_v1
#   spec_eagle3_clean    test/registered/kv_canary/test_e2e_speculative_gpu.py -k other_algorithms and clean and EAGLE3
#   spec_eagle3_faults   test/registered/kv_canary/test_e2e_speculative_gpu.py -k other_algorithms and every_fault and EAGLE3
#   spec_nextn_clean     test/registered/kv_canary/test_e2e_speculative_gpu.py -k other_algorithms and clean and NEXTN
#   spec_nextn_faults    test/registered/kv_canary/test_e2e_speculative_gpu.py -k other_algorithms and every_fault and NEXTN
#   spec_standalone_clean test/registered/kv_canary/test_e2e_speculative_gpu.py -k standalone and clean
#   spec_standalone_faults_v1 test/registered/kv_canary/test_e2e_speculative_gpu.py -k standalone and every_fault and spec_v1
#   spec_standalone_faults_v2 test/registered/kv_canary/test_e2e_speculative_gpu.py -k standalone and every_fault and spec_v2
#   spec_standalone_radix_keys test/registered/kv_canary/test_e2e_speculative_gpu.py -k standalone and radix_keys
#   spec_tree_clean      test/registered/kv_canary/test_e2e_speculative_gpu.py -k tree and clean and not paged
#   spec_tree_faults     test/registered/kv_canary/test_e2e_speculative_gpu.py -k tree and every_fault and not paged
#   spec_tree_paged      test/registered/kv_canary/test_e2e_speculative_gpu.py -k tree and paged and clean
#   spec_tree_paged_rounds test/registered/kv_canary/test_e2e_speculative_gpu.py -k tree and paged and rounds
#   spec_tree_paged_faults test/registered/kv_canary/test_e2e_speculative_gpu.py -k tree and paged and every_fault
#   spec_ngram_clean     test/registered/kv_canary/test_e2e_speculative_gpu.py -k ngram and clean and not paged
#   spec_ngram_faults    test/registered/kv_canary/test_e2e_speculative_gpu.py -k ngram and every_fault and not paged
#   spec_ngram_paged     test/registered/kv_canary/test_e2e_speculative_gpu.py -k ngram and paged
#   spec_dflash_clean    test/registered/kv_canary/test_e2e_speculative_gpu.py -k dflash and clean and not paged and not window
#   spec_dflash_faults   test/registered/kv_canary/test_e2e_speculative_gpu.py -k dflash and every_fault and not paged and not window
#   spec_dflash_paged    test/registered/kv_canary/test_e2e_speculative_gpu.py -k dflash and paged
#   spec_dflash_window   test/registered/kv_canary/test_e2e_speculative_gpu.py -k dflash and window
#   spec_oracle          test/registered/kv_canary/test_e2e_speculative_gpu.py -k token_oracle and outputs
#   spec_oracle_swap     test/registered/kv_canary/test_e2e_speculative_gpu.py -k token_oracle and swap
#   spec_frozen_kv_mtp_clean test/registered/kv_canary/test_e2e_speculative_gpu.py -k frozen_kv_mtp and clean
#   spec_frozen_kv_mtp_faults test/registered/kv_canary/test_e2e_speculative_gpu.py -k frozen_kv_mtp and every_fault
#   spec_multi_layer_clean test/registered/kv_canary/test_e2e_speculative_gpu.py -k multi_layer and clean
#   spec_multi_layer_faults test/registered/kv_canary/test_e2e_speculative_gpu.py -k multi_layer and every_fault
#   spec_multi_layer_radix test/registered/kv_canary/test_e2e_speculative_gpu.py -k multi_layer and radix
#   spec_multi_layer_oracle test/registered/kv_canary/test_e2e_speculative_gpu.py -k multi_layer and token_oracle
#   e2e_swa_gpu          test/registered/kv_canary/test_e2e_swa_gpu.py
#   tp2_clean            test/registered/kv_canary/test_e2e_tp_gpu.py -k clean (2 GPUs)
#   tp2_fault            test/registered/kv_canary/test_e2e_tp_gpu.py -k fault (2 GPUs)
#   kernels_cuda_graph   test/registered/kv_canary/test_kernels_cuda_graph.py
#   memory_gpu           test/registered/kv_canary/test_memory_gpu.py -k not alone_on_the_gpu
#   memory_gpu_alone     test/registered/kv_canary/test_memory_gpu.py -k alone_on_the_gpu and keeps (alone: no other lane on its GPU)
#   memory_gpu_tight     test/registered/kv_canary/test_memory_gpu.py -k alone_on_the_gpu and tight (alone: no other lane on its GPU)
#   runtime_cuda         test/registered/kv_canary/test_runtime_cuda.py
# (end of lanes)
exec python3 "$(dirname "$0")/gpu_lanes.py" "$@"
