//! Download progress: an indicatif bar per file (bytes, speed, ETA), drawn only when stderr is a
//! terminal.

/// One file's bar.
pub struct Bar {
    pub pb: indicatif::ProgressBar,
}

impl Bar {
    pub fn new(label: String) -> Self {
        let pb = indicatif::ProgressBar::with_draw_target(
            Some(0),
            indicatif::ProgressDrawTarget::stderr(),
        );
        pb.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        pb.set_message(label);
        Self { pb }
    }

    /// The file is `total` bytes, of which `done` are already on disk (a resumed download).
    pub fn start(&self, total: u64, done: u64) {
        self.pb.set_length(total);
        self.pb.set_position(done);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.pb.finish_and_clear();
    }
}
