//! clip_grad_norm, AverageMeter and metrics averaged across ranks.
