// Sampling, computed in the page from stored logits, as gpt2kit.sampling.sampler.warp computes it:
// temperature (below 1e-5: greedy, the argmax) -> top-k (ties with the k-th kept) -> top-p (OpenAI
// sample.py's: the most probable tokens while their cumulative probability stays <= p, at least one,
// ties kept) -> min-p (drop the tokens less likely than min_p x the most likely) -> softmax over the rest.
// Shared by the trace report and gpt2kit explore.
var GPT2Sampling=(function(){
'use strict';
var GREEDY_BELOW=1e-5;
function b64f32(s){var b=atob(s),u=new Uint8Array(b.length);for(var i=0;i<b.length;i++)u[i]=b.charCodeAt(i);
  return new Float32Array(u.buffer);}
// token indices by logit, largest first (the first index on ties, as torch's argmax); kept with the logits
function order(logits){
  if(logits._order)return logits._order;
  var a=new Array(logits.length);for(var i=0;i<a.length;i++)a[i]=i;
  a.sort(function(x,y){return (logits[y]-logits[x])||(x-y);});
  logits._order=Uint32Array.from(a);return logits._order;
}
// the model's own softmax (temperature 1, nothing removed), by token id
function softmax(logits){
  if(logits._probs)return logits._probs;
  var o=order(logits),m=logits[o[0]],z=0,p=new Float64Array(logits.length),i;
  for(i=0;i<p.length;i++){p[i]=Math.exp(logits[i]-m);z+=p[i];}
  for(i=0;i<p.length;i++)p[i]/=z;
  logits._probs=p;return p;
}
// {order, kept: how many of order survive, probs: their probabilities (in order's order), greedy}
function warp(logits,s){
  var o=order(logits),V=o.length,i;
  if(!(s.temperature>=GREEDY_BELOW))return {order:o,kept:1,probs:new Float64Array([1]),greedy:true};
  var v=new Float64Array(V);for(i=0;i<V;i++)v[i]=logits[o[i]]/s.temperature;
  function ties(n,lim){while(n<lim&&v[n]===v[n-1])n++;return n;}
  var n=V;
  if(s.top_k>0&&s.top_k<V)n=ties(s.top_k,V);
  if(s.top_p<1){var z=0,c=0,m=0;for(i=0;i<n;i++)z+=Math.exp(v[i]-v[0]);
    for(i=0;i<n;i++){c+=Math.exp(v[i]-v[0])/z;if(c<=s.top_p)m=i+1;else break;}
    n=ties(Math.max(m,1),n);}
  if(s.min_p>0){var k=1;while(k<n&&Math.exp(v[k]-v[0])>=s.min_p)k++;n=k;}
  var p=new Float64Array(n),t=0;for(i=0;i<n;i++){p[i]=Math.exp(v[i]-v[0]);t+=p[i];}
  for(i=0;i<n;i++)p[i]/=t;
  return {order:o,kept:n,probs:p,greedy:false};
}
function pct1(p){return (100*p).toFixed(1)+'%';}
var SLIDERS=[['temperature','temperature',0,2,0.05,1],['top_k','top-k (0 = off)',0,100,1,0],
  ['top_p','top-p (1 = off)',0.01,1,0.01,1],['min_p','min-p (0 = off)',0,0.5,0.01,0]];
// Sliders and a top-10 table in box; set(logits, tok) shows a distribution, tok(id) names a token.
function widget(box,prefix){
  var logits=null,tok=function(i){return '<'+i+'>';},inputs={},out={};
  var form=document.createElement('div');form.className='sliders';
  SLIDERS.forEach(function(d){
    var lab=document.createElement('label'),inp=document.createElement('input'),val=document.createElement('output');
    inp.type='range';inp.min=d[2];inp.max=d[3];inp.step=d[4];inp.value=d[5];inp.id=prefix+d[0].replace('_','-');
    val.id=inp.id+'-value';val.textContent=String(d[5]);
    lab.appendChild(document.createTextNode(d[1]+' '));lab.appendChild(inp);lab.appendChild(val);form.appendChild(lab);
    inputs[d[0]]=inp;out[d[0]]=val;
    inp.addEventListener('input',function(){val.textContent=inp.value;render();});
  });
  var info=document.createElement('p');info.className='help';info.id=prefix+'kept';
  var table=document.createElement('table');table.className='dist';table.id=prefix+'top';
  var wrap=document.createElement('div');wrap.className='wrap';wrap.appendChild(table);
  box.appendChild(form);box.appendChild(info);box.appendChild(wrap);
  function settings(){return {temperature:+inputs.temperature.value,top_k:+inputs.top_k.value,
    top_p:+inputs.top_p.value,min_p:+inputs.min_p.value};}
  function render(){
    if(!logits)return;
    var s=settings(),w=warp(logits,s),raw=softmax(logits),rows=['<tr><th>#</th><th>token</th><th>model p</th>'+
      '<th>with settings</th></tr>'];
    for(var r=0;r<Math.min(10,w.order.length);r++){var id=w.order[r],kept=r<w.kept;
      rows.push('<tr data-id="'+id+'"'+(kept?'':' class="removed"')+'><td>'+(r+1)+'</td><td class="tk"></td><td class="raw">'+
        pct1(raw[id])+'</td><td class="warped">'+(kept?pct1(w.probs[r]):'removed')+'</td></tr>');}
    table.innerHTML=rows.join('');
    var cells=table.querySelectorAll('td.tk');
    for(r=0;r<cells.length;r++)cells[r].textContent=JSON.stringify(tok(w.order[r]));
    info.textContent=w.greedy?'temperature below 1e-5: greedy, the most likely token always':
      w.kept+' of '+logits.length+' tokens can be drawn; the probabilities are renormalised over them';
  }
  return {settings:settings,render:render,inputs:inputs,
    set:function(l,t){logits=l;if(t)tok=t;render();}};
}
return {b64f32:b64f32,order:order,softmax:softmax,warp:warp,widget:widget,pct1:pct1};
})();
