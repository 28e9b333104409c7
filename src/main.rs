//! `kvreplay`: the command-line front end. Libraries return typed errors;
//! this binary adds context and prints them.

mod bench;
mod cli;

fn main() {
    restore_sigpipe();
    #[cfg(feature = "python")]
    if let Err(e) = _kvreplay::embed() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    if let Err(e) = cli::run() {
        eprintln!("error: {}", cli::error_text(&e));
        std::process::exit(1);
    }
}

/// Die quietly on a closed pipe (`kvreplay inspect T | head`) like other Unix
/// tools, instead of panicking in `println!`.
fn restore_sigpipe() {
    #[cfg(unix)]
    {
        extern "C" {
            fn signal(signum: i32, handler: usize) -> usize;
        }
        const SIGPIPE: i32 = 13;
        const SIG_DFL: usize = 0;
        // SAFETY: resetting a signal disposition to its default at start-up,
        // before any other thread exists.
        unsafe {
            signal(SIGPIPE, SIG_DFL);
        }
    }
}
