//! `mlx-spec`: the command line of the mlx-spec workspace.
//!
//! Today it has `info`, which prints what this binary runs on (MLX version, device,
//! backend, BLAS), the first thing to run on a new machine. Generation, quantization and
//! the drafter commands come with their crates.
use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "mlx-spec", version, about = "Lossless speculative decoding and drafter quantization on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the MLX version, device, backend and BLAS in use, and run a tiny matmul.
    Info {
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Info { json } => info(json),
    }
}

fn info(json: bool) -> Result<()> {
    // A first f32 matmul selects the BLAS and proves the library works end to end.
    let a = mlx_core::Array::from_slice(&[1f32, 2., 3., 4.], &[2, 2])?;
    let check = a.matmul(&a)?.to_vec::<f32>()?;
    anyhow::ensure!(check == [7., 10., 15., 22.], "MLX computed a wrong 2x2 matmul: {check:?}");
    let i = mlx_core::info();
    if json {
        println!(
            "{}",
            serde_json::json!({
                "mlx_version": i.mlx_version,
                "device": i.device,
                "backend": i.backend.to_string(),
                "blas": i.blas,
                "mlx_root": i.mlx_root,
                "mlx_spec_version": env!("CARGO_PKG_VERSION"),
            })
        );
    } else {
        println!("mlx-spec   {}", env!("CARGO_PKG_VERSION"));
        println!("mlx        {}", i.mlx_version);
        println!("device     {}", i.device);
        println!("backend    {}", i.backend);
        println!("blas       {}", i.blas);
        println!("libmlx     {}", i.mlx_root);
    }
    Ok(())
}
