#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    modelfs::cli::main()
}
