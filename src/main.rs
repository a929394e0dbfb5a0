fn main() -> anyhow::Result<()> {
    modelfs::cli::main()
}
