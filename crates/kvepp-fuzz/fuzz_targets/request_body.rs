#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvepp_fuzz::targets::request_body(data));
