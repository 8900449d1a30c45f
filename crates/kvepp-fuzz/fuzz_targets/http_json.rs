#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvepp_fuzz_targets::http_json(data));
