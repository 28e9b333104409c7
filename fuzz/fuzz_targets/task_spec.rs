#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvreplay_fuzz::task_spec(data);
});
