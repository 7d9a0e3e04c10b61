fn main() {
    println!("xtask: TODO");
}
