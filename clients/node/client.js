#!/usr/bin/env node
// Streams minisgl.v1.Generation/GenerateStream from a minisgl gateway and prints the text as it
// arrives; the usage of the last message goes to stderr as one JSON line.
//
//   node client.js --target 127.0.0.1:50051 --prompt "In the beginning" --max-tokens 16
//
// Options: --target, --prompt, --max-tokens, --temperature, --seed, --api-key, --timeout (s).

"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "protos");

function parseArgs(argv) {
  const args = { target: "127.0.0.1:50051", prompt: "In the beginning", maxTokens: 16,
                 temperature: null, seed: null, apiKey: process.env.MINISGL_API_KEY || "",
                 timeout: 120 };
  for (let i = 0; i < argv.length; i += 2) {
    const [flag, value] = [argv[i], argv[i + 1]];
    if (value === undefined) throw new Error(`missing value for ${flag}`);
    switch (flag) {
      case "--target": args.target = value; break;
      case "--prompt": args.prompt = value; break;
      case "--max-tokens": args.maxTokens = parseInt(value, 10); break;
      case "--temperature": args.temperature = parseFloat(value); break;
      case "--seed": args.seed = value; break;
      case "--api-key": args.apiKey = value; break;
      case "--timeout": args.timeout = parseFloat(value); break;
      default: throw new Error(`unknown option ${flag}`);
    }
  }
  return args;
}

function loadGeneration() {
  const definition = protoLoader.loadSync("minisgl/v1/generation.proto", {
    includeDirs: [PROTO_ROOT], keepCase: true, longs: String, enums: String, defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).minisgl.v1.Generation;
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  const Generation = loadGeneration();
  const client = new Generation(args.target, grpc.credentials.createInsecure());
  const sampling = { max_tokens: args.maxTokens };
  if (args.temperature !== null) sampling.temperature = args.temperature;
  if (args.seed !== null) sampling.seed = args.seed;
  const metadata = new grpc.Metadata();
  if (args.apiKey) metadata.set("authorization", `Bearer ${args.apiKey}`);
  const deadline = new Date(Date.now() + args.timeout * 1000);

  const call = client.GenerateStream({ text: args.prompt, sampling }, metadata, { deadline });
  let usage = null;
  let finish = null;
  call.on("data", (reply) => {
    for (const choice of reply.choices) {
      process.stdout.write(choice.text);
      if (choice.finish_reason !== "FINISH_REASON_UNSPECIFIED") finish = choice.finish_reason;
    }
    if (reply.usage) usage = reply.usage;
  });
  call.on("error", (err) => {
    process.stderr.write(`\nerror: ${grpc.status[err.code]}: ${err.details}\n`);
    process.exitCode = 1;
  });
  call.on("end", () => {
    process.stderr.write(JSON.stringify({ finish_reason: finish, usage }) + "\n");
    client.close();
  });
}

main();
