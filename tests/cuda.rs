//! The GPU tests (feature `cuda`): one binary with its own harness (`cuda_common::run_gpu_tests`,
//! over libtest-mimic), so that on a machine without a GPU each test that needs one is reported
//! as ignored, not as passed, and `GPUFEED_REQUIRE_GPU=1` makes no GPU a failure. A test is a
//! plain `pub fn` listed below: one left out of the list is dead code, which the lints refuse.

mod cuda_common;
mod image_common;
mod token_common;

#[cfg(feature = "candle-cuda")]
mod cuda_candle;
mod cuda_convert;
mod cuda_copy;
mod cuda_decode;
mod cuda_device;
mod cuda_images;
mod cuda_ragged;
mod cuda_raw_streams;
mod cuda_resume;
mod cuda_sound;
mod cuda_tokens;

fn main() -> std::process::ExitCode {
    #[allow(unused_mut)]
    let mut tests = gpu_tests![
        cuda_convert: [
            conversion_matches_the_cpu_reference,
            conversion_rejects_bad_settings,
            the_device_loader_converts_fields_end_to_end,
        ],
        cuda_copy: [
            copied_bytes_equal_the_source_with_poisoned_device_buffers,
            two_pinned_buffers_are_never_reused_under_a_copy_in_flight,
            dropping_the_loader_mid_epoch_stops_promptly,
            consumer_stream_waits_and_buffers_are_recycled_behind_it,
            pinned_copy_ceiling_is_measured,
            batches_made_in_parts_reach_the_device_with_exact_bytes,
        ],
        cuda_decode: [
            gpu_decoded_batches_match_the_cpu_path_for_every_kind,
            corrupt_jpegs_are_typed_errors_naming_the_sample_or_skipped,
            huge_declared_jpegs_are_refused_before_allocation,
            resumed_gpu_decode_delivers_the_same_batches,
            the_workers_decode_while_the_decoders_are_made_then_the_gpu_takes_its_share,
            device_memory_does_not_grow_over_50_epochs,
        ] without_gpu: [nvjpeg_loads_or_says_what_is_missing],
        cuda_device: [
            device_opens_with_a_copy_stream_and_kernels,
            a_device_on_the_callers_context_leaves_its_settings_and_copies,
        ] without_gpu: [
            open_without_a_driver_is_no_gpu_not_a_panic,
            an_invalid_ordinal_is_an_error,
        ],
        cuda_images: [device_normalised_batches_equal_the_host_ones],
        cuda_ragged: [
            ragged_fields_reach_the_device_with_every_byte,
            a_ragged_batch_over_its_budget_is_an_error_through_the_copy_stage,
            a_conversion_of_a_ragged_field_is_refused,
        ],
        cuda_raw_streams: [
            a_block_is_reused_only_after_the_raw_consumer_stream_passed_its_read,
            wait_on_raw_orders_the_consumer_after_a_copy_still_queued,
            foreign_threads_keep_their_current_context,
            next_timeout_moves_nothing,
            mask_and_indices_fields_match_the_host_batches,
            batches_outlive_their_loader_and_many_loaders_leave_no_memory,
        ],
        cuda_resume: [
            device_loaders_resume_exactly_through_the_readme_loop_twice,
            load_state_on_a_running_device_loader_continues_from_the_state,
            a_host_budget_of_one_batch_delivers_every_device_batch,
            evaluation_masks_travel_with_device_batches,
        ],
        cuda_sound: [
            a_dropped_buffer_is_not_reused_under_its_fill,
            a_converter_launch_keeps_its_buffers_until_it_ran,
            a_slow_consumer_stream_never_sees_a_batch_overwritten,
            poisoned_device_batches_hold_every_byte_of_the_host_batches,
            the_device_context_keeps_event_tracking,
        ],
        cuda_tokens: [
            device_token_batches_are_the_host_ones_widened_on_the_gpu,
            widening_refuses_what_it_cannot_widen,
        ],
    ];
    #[cfg(feature = "candle-cuda")]
    tests.extend(gpu_tests![cuda_candle: [
        tensors_held_across_later_batches_keep_every_element,
        every_dtype_reaches_candle_as_the_host_batch_holds_it,
    ]]);
    cuda_common::run_gpu_tests(tests)
}
