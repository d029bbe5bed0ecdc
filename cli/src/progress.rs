//! A one-line status for long work (`bench`, `soak`), redrawn in place on
//! stderr while stderr is a terminal, and nothing at all otherwise: logs
//! and pipes get the results, not a stream of redraws.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// How often the line is redrawn at most.
const EVERY: Duration = Duration::from_millis(250);

/// The status line.
pub struct Progress {
    /// Where it is drawn; `None`: off.
    sink: Option<Box<dyn Write + Send>>,
    last: Option<Instant>,
    /// Characters of the line drawn last, to blank what a shorter one
    /// leaves.
    drawn: usize,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("on", &self.sink.is_some())
            .field("drawn", &self.drawn)
            .finish()
    }
}

impl Progress {
    /// Drawn on stderr when it is a terminal; off otherwise.
    pub fn stderr() -> Self {
        let on = std::io::stderr().is_terminal();
        Self::to(on.then(|| Box::new(std::io::stderr()) as Box<dyn Write + Send>))
    }

    /// Drawn on `sink`, or off.
    pub fn to(sink: Option<Box<dyn Write + Send>>) -> Self {
        Self {
            sink,
            last: None,
            drawn: 0,
        }
    }

    /// Redraws the line from `line()` when on and [`EVERY`] has passed
    /// since the last draw (`line` is not called otherwise).
    pub fn update(&mut self, line: impl FnOnce() -> String) {
        let Some(sink) = self.sink.as_mut() else {
            return;
        };
        if self.last.is_some_and(|t| t.elapsed() < EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        let text = line();
        let _ = sink.write_all(redraw(&text, self.drawn).as_bytes());
        let _ = sink.flush();
        self.drawn = text.chars().count();
    }

    /// Blanks the line, so what is printed next starts on a clean one.
    pub fn finish(&mut self) {
        if let Some(sink) = self.sink.as_mut().filter(|_| self.drawn > 0) {
            let _ = sink.write_all(redraw("", self.drawn).as_bytes());
            let _ = sink.flush();
            self.drawn = 0;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// What redraws `text` over a line of `drawn` characters: back to the
/// line's start, the text, blanks over the rest of the old one, back again
/// after the text.
fn redraw(text: &str, drawn: usize) -> String {
    let n = text.chars().count();
    let pad = drawn.saturating_sub(n);
    format!("\r{text}{}{}", " ".repeat(pad), "\u{8}".repeat(pad))
}

/// `done` of `total` (when known) after `elapsed`, with the rate: the
/// status `bench` and `soak` draw.
pub fn count_line(what: &str, done: u64, total: Option<u64>, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
    match total {
        Some(t) => format!("{what}: {done}/{t} requests, {secs:.0} s, {rate:.1}/s"),
        None => format!("{what}: {done} requests, {secs:.0} s, {rate:.1}/s"),
    }
}

/// A task redrawing [`count_line`] of a shared counter until
/// [`Ticker::stop`].
#[derive(Debug)]
pub struct Ticker {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Ticker {
    /// Starts drawing `what`'s `done` of `total` on stderr (when it is a
    /// terminal; otherwise the task only waits for the stop).
    pub fn start(
        what: &'static str,
        done: std::sync::Arc<std::sync::atomic::AtomicU64>,
        total: Option<u64>,
    ) -> Self {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut p = Progress::stderr();
            let started = Instant::now();
            loop {
                let n = done.load(std::sync::atomic::Ordering::Relaxed);
                p.update(|| count_line(what, n, total, started.elapsed()));
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(EVERY) => {}
                }
            }
            p.finish();
        });
        Self { stop, task }
    }

    /// Stops and blanks the line before the caller prints its results.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shorter_line_blanks_what_the_longer_one_left() {
        assert_eq!(redraw("abc", 0), "\rabc");
        assert_eq!(redraw("ab", 5), "\rab   \u{8}\u{8}\u{8}");
        assert_eq!(redraw("", 2), "\r  \u{8}\u{8}");
    }

    /// A sink the test reads back.
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Buf {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().expect("lock").clone()).expect("utf-8")
        }
    }

    #[test]
    fn off_draws_nothing_and_never_builds_the_line() {
        let mut p = Progress::to(None);
        p.update(|| unreachable!("the line is not built when off"));
        p.finish();
        assert_eq!(p.drawn, 0);
    }

    #[test]
    fn redraws_are_spaced_and_the_line_is_blanked_at_the_end() {
        let buf = Buf::default();
        let mut p = Progress::to(Some(Box::new(buf.clone())));
        let mut built = 0;
        for _ in 0..5 {
            p.update(|| {
                built += 1;
                "abc".into()
            });
        }
        assert_eq!(built, 1, "four more within {EVERY:?} were skipped");
        drop(p);
        assert_eq!(buf.text(), "\rabc\r   \u{8}\u{8}\u{8}");
    }

    #[test]
    fn the_count_line_says_done_total_and_rate() {
        assert_eq!(
            count_line("bench", 30, Some(200), Duration::from_secs(10)),
            "bench: 30/200 requests, 10 s, 3.0/s"
        );
        assert_eq!(
            count_line("soak", 5, None, Duration::ZERO),
            "soak: 5 requests, 0 s, 0.0/s"
        );
    }
}
