//! safetensors checkpoint files (`ipuq import`, `init = { safetensors = … }`): the header is
//! parsed and checked against the file's length, then every tensor it declares is read and
//! converted. No file may panic, hang or allocate more than the file declares.
#![no_main]

use std::io::Cursor;
use std::path::Path;

use ipuq::workload::safetensors::Header;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut reader = Cursor::new(data);
    if let Ok(header) = Header::parse(&mut reader, data.len() as u64, Path::new("fuzz.safetensors")) {
        for name in header.names() {
            if let Ok(tensor) = header.read_from(&mut reader, &name) {
                let _ = tensor.values();
                let _ = tensor.digest();
            }
        }
    }
});
