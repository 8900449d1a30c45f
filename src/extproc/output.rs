//! How many output tokens a streamed (server-sent events) response carried, read from the body
//! chunks Envoy passes on: the engine's own count when it reports usage (`"completion_tokens":`
//! in the final event, with `stream_options.include_usage`), else one per `data:` event that is
//! not `[DONE]` (vLLM and SGLang send a token per event unless told to batch them). The decode
//! model learns each response's mean step from it.
//!
//! Invariants: chunks may split an event or a number anywhere (a line's start and a short tail
//! are carried over); memory is bounded by those; nothing in a body can make it fail.

/// Bytes kept from one chunk to the next: enough for the usage key and a number split across.
const TAIL: usize = 48;
/// Bytes of a line kept: enough to tell `data: [DONE]`.
const HEAD: usize = 16;
const USAGE_KEY: &[u8] = b"\"completion_tokens\":";
const EVENT: &[u8] = b"data:";
const DONE: &[u8] = b"[DONE]";

/// The count so far of one response.
#[derive(Debug, Default)]
pub(crate) struct OutputTokens {
    /// `data:` lines ended, `[DONE]` not counted.
    events: u64,
    usage: Option<u64>,
    /// The start of the line being read.
    head: [u8; HEAD],
    head_len: usize,
    /// The last bytes read (the usage key or its number may go on in the next chunk).
    tail: Vec<u8>,
}

impl OutputTokens {
    /// Reads one body chunk.
    pub(crate) fn read(&mut self, chunk: &[u8]) {
        let mut line = chunk;
        loop {
            let (part, next) = match memchr::memchr(b'\n', line) {
                Some(at) => (&line[..at], Some(&line[at + 1..])),
                None => (line, None),
            };
            let n = part.len().min(HEAD - self.head_len);
            self.head[self.head_len..self.head_len + n].copy_from_slice(&part[..n]);
            self.head_len += n;
            let Some(next) = next else { break };
            self.events += u64::from(self.is_event());
            self.head_len = 0;
            line = next;
        }
        // Usage: in the chunk, and across its junction with the bytes before it.
        self.tail.extend_from_slice(&chunk[..chunk.len().min(TAIL)]);
        let junction = std::mem::take(&mut self.tail);
        self.scan_usage(&junction);
        self.tail = junction;
        if chunk.len() > TAIL {
            self.scan_usage(chunk);
            self.tail.clear();
            self.tail.extend_from_slice(&chunk[chunk.len() - TAIL..]);
        } else {
            let excess = self.tail.len().saturating_sub(TAIL);
            self.tail.drain(..excess);
        }
    }

    /// Whether the line read so far is an event other than `[DONE]`.
    fn is_event(&self) -> bool {
        self.head[..self.head_len]
            .strip_prefix(EVENT)
            .is_some_and(|rest| !trim_start(rest).starts_with(DONE))
    }

    /// Every complete `"completion_tokens": N` in `buf` (the last one read wins; a number at
    /// the very end of `buf` may go on, and is read with the next chunk).
    fn scan_usage(&mut self, buf: &[u8]) {
        let mut i = 0;
        while let Some(at) = find(&buf[i..], USAGE_KEY).map(|k| k + i) {
            let digits = trim_start(&buf[at + USAGE_KEY.len()..]);
            let n = digits.iter().take_while(|b| b.is_ascii_digit()).count();
            if n > 0 && n < digits.len() {
                if let Ok(v) = std::str::from_utf8(&digits[..n]).unwrap_or("").parse() {
                    self.usage = Some(v);
                }
            }
            i = at + USAGE_KEY.len();
        }
    }

    /// The output tokens: the reported usage, else the events (a last line without its newline
    /// included).
    pub(crate) fn count(&self) -> u64 {
        self.usage
            .unwrap_or(self.events + u64::from(self.is_event()))
    }
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| **c == b' ').count();
    &b[n..]
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(hay, needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(tokens: usize, usage: bool) -> Vec<u8> {
        let mut s = String::new();
        for i in 0..tokens {
            s.push_str(&format!(
                "data: {{\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}]}}\n\n"
            ));
        }
        if usage {
            s.push_str(&format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":9,\"completion_tokens\":{tokens},\"total_tokens\":{}}}}}\n\n",
                tokens + 9
            ));
        }
        s.push_str("data: [DONE]\n\n");
        s.into_bytes()
    }

    fn counted(body: &[u8], cut: usize) -> u64 {
        let mut o = OutputTokens::default();
        for c in body.chunks(cut) {
            o.read(c);
        }
        o.count()
    }

    #[test]
    fn counts_events_or_reads_usage_however_the_body_is_cut() {
        for cut in [1, 2, 3, 5, 7, 16, 47, 1000, 1 << 20] {
            assert_eq!(
                counted(&stream(37, false), cut),
                37,
                "events, chunks of {cut}"
            );
            // Usage wins over the events (which count its own event too).
            assert_eq!(
                counted(&stream(37, true), cut),
                37,
                "usage, chunks of {cut}"
            );
        }
        let mut big = stream(3, false);
        big.splice(
            0..0,
            b"data: {\"usage\":{\"completion_tokens\":12345}}\n\n"
                .iter()
                .copied(),
        );
        assert_eq!(counted(&big, 4), 12345);
    }

    #[test]
    fn garbage_counts_what_it_can_and_never_fails() {
        assert_eq!(counted(b"", 3), 0);
        assert_eq!(counted(b"data: {\"completion_tokens\":5}\n", 100), 5);
        assert_eq!(counted(b"{\"not\":\"sse\"}", 3), 0);
        assert_eq!(
            counted(b"xdata: 1\n data: 2\ndata:3\ndata: [DONE]\ndata: 4", 2),
            2
        );
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..500 {
            let alphabet = b"data:[DONE]\n \"completion_tokens\":9";
            let body: Vec<u8> = (0..rng.usize(..200))
                .map(|_| alphabet[rng.usize(..alphabet.len())])
                .collect();
            counted(&body, rng.usize(1..20));
        }
    }
}
