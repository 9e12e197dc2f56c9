//! Thin entry point: parse the command line, run the command, map errors to exit codes.

use clap::Parser;

fn main() {
    // Every file gpu-medic writes (state, journals, evidence archives, request files) is
    // private whatever umask it was started with: folders 0700, files 0600.
    // SAFETY: umask(2) has no preconditions and cannot fail.
    unsafe {
        libc::umask(0o077);
    }
    let cli = gpu_medic::cli::Cli::parse();
    let code = match gpu_medic::cli::dispatch(cli) {
        Ok(code) => code,
        Err(e) => {
            let e = anyhow::Error::new(e);
            let code = e
                .downcast_ref::<gpu_medic::cli::CliError>()
                .map_or(1, |c| c.exit_code());
            // Not eprintln!: it panics when stderr is a closed pipe. Escaped, as every line a
            // command prints: an error can quote text others wrote (src/cli/out.rs).
            gpu_medic::cli::out::eline(format_args!("gpu-medic: {e:#}"));
            code
        }
    };
    std::process::exit(code);
}
